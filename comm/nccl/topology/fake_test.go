//go:build linux && (amd64 || arm64)

package topology

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/internal/dynlib"
)

// fakeNVML is testdata/fakenvml.c, compiled with gcc against NVIDIA's
// nvml.h as go-nvml ships it, and the functions that set the machine it
// reports. Discover loads the same library through NVMLEnv: a second
// dlopen of one path returns the same handle, so the test's settings are
// what Discover reads.
type fakeNVML struct {
	path           string
	reset          func(n int32)
	setGPU         func(i int32, name, uuid, bus string)
	setLink        func(i, link, state int32, remote string, kind int32)
	setLevel       func(i, j, level int32)
	fail           func(fn string, ret, gpu int32)
	inits          func() int32
	shutdowns      func() int32
	pciSize        func() int32
	pciBusIDOffset func() int32
	maxLinks       func() int32
}

var (
	fakeOnce sync.Once
	fakeLib  *fakeNVML
	fakeErr  error
)

// errNoGCC marks the one reason the fake may be skipped.
var errNoGCC = errors.New("no gcc to build the fake NVML")

// nvmlHeaderDir returns the folder of go-nvml's nvml.h, downloading the
// module (the version go.mod requires) when the module cache lacks it.
func nvmlHeaderDir() (string, error) {
	out, err := exec.Command("go", "mod", "download", "-json", "github.com/NVIDIA/go-nvml").Output()
	if err != nil {
		return "", fmt.Errorf("go mod download github.com/NVIDIA/go-nvml (for nvml.h): %w", err)
	}
	var m struct{ Dir, Error string }
	if err := json.Unmarshal(out, &m); err != nil || m.Dir == "" {
		return "", fmt.Errorf("go mod download github.com/NVIDIA/go-nvml: %v %s", err, m.Error)
	}
	return filepath.Join(m.Dir, "pkg", "nvml"), nil
}

// buildFakeNVML compiles and binds the fake once per test binary, in a
// folder that the test binary's process removes at exit (TestMain is not
// needed: the .so is small and under the system's temporary folder).
func buildFakeNVML(dir string) (*fakeNVML, error) {
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errNoGCC, err)
	}
	inc, err := nvmlHeaderDir()
	if err != nil {
		return nil, err
	}
	lib := filepath.Join(dir, "libfakenvml.so")
	cmd := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-g", "-Wall", "-Werror", "-I", inc, "-o", lib, filepath.Join("testdata", "fakenvml.c"))
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("building the fake NVML: %v\n%s", err, out)
	}
	dl, err := dynlib.Open(lib)
	if err != nil {
		return nil, err
	}
	f := &fakeNVML{path: lib}
	if err := dl.Bind([]dynlib.Symbol{
		{Name: "fake_reset", Fn: &f.reset}, {Name: "fake_set_gpu", Fn: &f.setGPU}, {Name: "fake_set_link", Fn: &f.setLink},
		{Name: "fake_set_level", Fn: &f.setLevel}, {Name: "fake_fail", Fn: &f.fail}, {Name: "fake_inits", Fn: &f.inits},
		{Name: "fake_shutdowns", Fn: &f.shutdowns}, {Name: "fake_pci_size", Fn: &f.pciSize}, {Name: "fake_pci_busid_offset", Fn: &f.pciBusIDOffset},
		{Name: "fake_max_links", Fn: &f.maxLinks},
	}); err != nil {
		return nil, err
	}
	return f, nil
}

// useFakeNVML returns the fake with n GPUs and nothing else set, and points
// NVMLEnv at it for the test; it skips the test when gcc is missing.
func useFakeNVML(t *testing.T, n int32) *fakeNVML {
	t.Helper()
	fakeOnce.Do(func() {
		dir, err := os.MkdirTemp("", "loom-fakenvml-")
		if err != nil {
			fakeErr = err
			return
		}
		fakeLib, fakeErr = buildFakeNVML(dir)
	})
	if errors.Is(fakeErr, errNoGCC) {
		t.Skip(fakeErr)
	}
	if fakeErr != nil {
		t.Fatal(fakeErr)
	}
	t.Setenv(NVMLEnv, fakeLib.path)
	fakeLib.reset(n)
	return fakeLib
}

// NVML's values the fake is given (nvml.h).
const (
	linkGPU, linkSwitch      = 0, 2
	featureOff, featureOn    = 0, 1
	levelPIX, levelPXB       = 10, 20
	levelPHB, levelNODE      = 30, 40
	levelSYS                 = 50
	errNotSupported          = 3
	errDriverNotLoaded       = 9
	errGPULost               = 15
	busA, busB, busC, busD   = "00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000001:4E:00.0"
	normA, normB, normC      = "0000:07:00.0", "0000:0f:00.0", "0000:47:00.0"
	normD                    = "0001:4e:00.0"
	switch0, switch1         = "00000000:A0:00.0", "00000000:A1:00.0"
	normSwitch0, normSwitch1 = "0000:a0:00.0", "0000:a1:00.0"
)

// mixed is a 4-GPU machine: GPUs 0 and 1 joined by 4 NVLinks under one
// PCIe switch, GPUs 2 and 3 (3 active links, one down; one on the last
// link index) under a PCIe switch hierarchy, and links that Discover must
// skip: one whose other end NVML cannot read and one whose bus id does not
// parse.
func mixed(f *fakeNVML) {
	last := f.maxLinks() - 1 // NVML_NVLINK_MAX_LINKS of nvml.h
	for i, bus := range []string{busA, busB, busC, busD} {
		f.setGPU(int32(i), fmt.Sprintf("NVIDIA H100 80GB HBM3 #%d", i), fmt.Sprintf("GPU-%08x-aaaa-bbbb-cccc-dddddddddddd", i), bus)
	}
	for l := range int32(4) {
		f.setLink(0, l, featureOn, busB, linkGPU)
		f.setLink(1, l, featureOn, busA, linkGPU)
	}
	f.setLink(0, 4, featureOn, "", linkGPU)          // other end unreadable
	f.setLink(0, 5, featureOn, "not-a-bus", linkGPU) // other end unparsable
	f.setLink(2, 0, featureOn, busD, linkGPU)        //
	f.setLink(2, 1, featureOn, busD, linkGPU)        //
	f.setLink(2, 2, featureOff, busD, linkGPU)       // down
	f.setLink(2, last, featureOn, busD, linkGPU)     // the last index NVML has
	f.setLink(3, 0, featureOn, busC, linkGPU)
	f.setLink(3, 1, featureOn, busC, linkGPU)
	f.setLink(3, last, featureOn, busC, linkGPU)
	f.setLevel(0, 1, levelPIX)
	f.setLevel(2, 3, levelPXB)
	f.setLevel(0, 2, levelNODE)
	f.setLevel(1, 2, levelPHB)
	f.setLevel(0, 3, levelSYS)
	f.setLevel(1, 3, levelSYS)
}

// mixedTopology is what Discover must read from mixed.
func mixedTopology() *Topology {
	t := Uniform(4, "")
	t.Source = "nvml"
	peers := []map[string]int{{normB: 4}, {normA: 4}, {normD: 3}, {normC: 3}}
	for i, bus := range []string{normA, normB, normC, normD} {
		t.Devices[i] = Device{Index: i, Name: fmt.Sprintf("NVIDIA H100 80GB HBM3 #%d", i),
			UUID: fmt.Sprintf("GPU-%08x-aaaa-bbbb-cccc-dddddddddddd", i), BusID: bus, NVLinkPeers: peers[i]}
	}
	set := func(i, j int, l Link) { t.Links[i][j], t.Links[j][i] = l, l }
	set(0, 1, Link{NVLinks: 4, Path: PathSingle})
	set(2, 3, Link{NVLinks: 3, Path: PathMultiple})
	set(0, 2, Link{Path: PathNode})
	set(1, 2, Link{Path: PathHostBridge})
	set(0, 3, Link{Path: PathSystem})
	set(1, 3, Link{Path: PathSystem})
	return t
}

// TestDiscoverFake reads machines from the fake NVML and requires exactly
// the topology each one describes, or the error each failure must give;
// NVML is shut down once for every successful init.
func TestDiscoverFake(t *testing.T) {
	cases := []struct {
		name  string
		n     int32
		setup func(f *fakeNVML)
		want  func() *Topology
		err   error  // the sentinel the error must match, if any
		msg   string // what the error must say; "" for no error
	}{
		{name: "mixed", n: 4, setup: mixed, want: mixedTopology},
		{name: "nvswitch", n: 2, setup: func(f *fakeNVML) {
			f.setGPU(0, "NVIDIA H200", "GPU-0", busA)
			f.setGPU(1, "NVIDIA H200", "GPU-1", busB)
			for l := range int32(6) {
				sw := map[bool]string{true: switch0, false: switch1}[l < 3]
				f.setLink(0, l, featureOn, sw, linkSwitch)
				f.setLink(1, l, map[bool]int32{true: featureOff, false: featureOn}[l == 5], sw, linkSwitch)
			}
			f.setLevel(0, 1, levelSYS)
		}, want: func() *Topology {
			t := Uniform(2, "")
			t.Source = "nvml"
			t.Devices[0] = Device{Index: 0, Name: "NVIDIA H200", UUID: "GPU-0", BusID: normA, NVLinkPeers: map[string]int{normSwitch0: 3, normSwitch1: 3}, SwitchLinks: 6}
			t.Devices[1] = Device{Index: 1, Name: "NVIDIA H200", UUID: "GPU-1", BusID: normB, NVLinkPeers: map[string]int{normSwitch0: 3, normSwitch1: 2}, SwitchLinks: 5}
			t.Links[0][1] = Link{NVLinks: 5, Path: PathSystem}
			t.Links[1][0] = t.Links[0][1]
			return t
		}},
		{name: "no GPUs", n: 0, setup: func(*fakeNVML) {}, want: func() *Topology {
			t := Uniform(0, "")
			t.Source = "nvml"
			return t
		}},
		{name: "name and uuid unsupported", n: 1, setup: func(f *fakeNVML) {
			f.setGPU(0, "hidden", "hidden", busC)
			f.fail("nvmlDeviceGetName", errNotSupported, 0)
		}, want: func() *Topology {
			t := Uniform(1, "")
			t.Source = "nvml"
			t.Devices[0] = Device{Index: 0, UUID: "hidden", BusID: normC, NVLinkPeers: map[string]int{}}
			return t
		}},
		{name: "init fails", n: 4, setup: func(f *fakeNVML) { mixed(f); f.fail("nvmlInit_v2", errDriverNotLoaded, -1) },
			err: ErrUnavailable, msg: "nvmlInit: Driver Not Loaded (9)"},
		{name: "count fails", n: 4, setup: func(f *fakeNVML) { mixed(f); f.fail("nvmlDeviceGetCount_v2", errGPULost, -1) },
			msg: "topology: nvmlDeviceGetCount: GPU is lost (15)"},
		{name: "handle fails", n: 4, setup: func(f *fakeNVML) { mixed(f); f.fail("nvmlDeviceGetHandleByIndex_v2", errGPULost, 2) },
			msg: "topology: nvmlDeviceGetHandleByIndex(2): GPU is lost (15)"},
		{name: "pci fails", n: 4, setup: func(f *fakeNVML) { mixed(f); f.fail("nvmlDeviceGetPciInfo_v3", errGPULost, 3) },
			msg: "topology: GPU 3: nvmlDeviceGetPciInfo: GPU is lost (15)"},
		{name: "path unknown", n: 4, setup: func(f *fakeNVML) { mixed(f); f.fail("nvmlDeviceGetTopologyCommonAncestor", errNotSupported, 0) },
			want: func() *Topology {
				t := mixedTopology()
				for j := 1; j < 4; j++ {
					t.Links[0][j].Path, t.Links[j][0].Path = PathUnknown, PathUnknown
				}
				return t
			}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := useFakeNVML(t, c.n)
			c.setup(f)
			got, err := Discover()
			if c.msg != "" {
				if err == nil || !strings.Contains(err.Error(), c.msg) {
					t.Fatalf("Discover: %v, want an error saying %q", err, c.msg)
				}
				if c.err != nil && !errors.Is(err, c.err) {
					t.Errorf("Discover: %v, want it to match %v", err, c.err)
				}
				if c.err == nil && errors.Is(err, ErrUnavailable) {
					t.Errorf("Discover: %v matches ErrUnavailable: NVML loaded and initialised", err)
				}
			} else {
				if err != nil {
					t.Fatalf("Discover: %v", err)
				}
				if want := c.want(); !reflect.DeepEqual(got, want) {
					t.Errorf("Discover read\n%v%+v\nwant\n%v%+v", got, got.Devices, want, want.Devices)
				}
			}
			if i, s := f.inits(), f.shutdowns(); i != s {
				t.Errorf("nvmlInit succeeded %d times, nvmlShutdown %d", i, s)
			}
		})
	}
}

// TestDiscoverFakeDetect: Detect returns what Discover reads, and falls back
// to Uniform, naming the reason, when NVML is turned off, absent, or not
// NVML.
func TestDiscoverFakeDetect(t *testing.T) {
	f := useFakeNVML(t, 4)
	mixed(f)
	if got := Detect(8); !reflect.DeepEqual(got, mixedTopology()) {
		t.Errorf("Detect(8) with NVML = %v", got)
	}
	for _, c := range []struct{ env, msg string }{
		{"off", "nvml is disabled"},
		{filepath.Join(t.TempDir(), "libnvidia-ml.so.1"), "cannot open shared object file"},
		{"libc.so.6", "missing symbols nvmlInit_v2"},
	} {
		t.Setenv(NVMLEnv, c.env)
		_, err := Discover()
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), c.msg) || !strings.Contains(err.Error(), NVMLEnv) {
			t.Errorf("%s=%s: Discover: %v, want ErrUnavailable naming %s and saying %q", NVMLEnv, c.env, err, NVMLEnv, c.msg)
		}
		d := Detect(3)
		if len(d.Devices) != 3 || !strings.HasPrefix(d.Source, "uniform (") || !strings.Contains(d.Source, c.msg) {
			t.Errorf("%s=%s: Detect(3) = %v", NVMLEnv, c.env, d)
		}
	}
}

// TestPCIInfoLayout: Go's nvmlPciInfo_t is NVIDIA's, size and bus id
// offset (a wrong layout would also read wrong bus ids in TestDiscoverFake).
func TestPCIInfoLayout(t *testing.T) {
	f := useFakeNVML(t, 0)
	if got, want := int(f.pciSize()), int(unsafe.Sizeof(pciInfo{})); got != want {
		t.Errorf("sizeof(nvmlPciInfo_t) = %d in nvml.h, %d in Go", got, want)
	}
	if got, want := int(f.pciBusIDOffset()), int(unsafe.Offsetof(pciInfo{}.busID)); got != want {
		t.Errorf("offsetof(nvmlPciInfo_t, busId) = %d in nvml.h, %d in Go", got, want)
	}
}
