//go:build linux && cgo && gonvml

package topology

import (
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// This file keeps go-nvml, NVIDIA's own Go binding, where it serves: as
// the reference that Discover's purego binding is checked against on a
// machine with GPUs (`go test -tags gonvml ./comm/nccl/topology`, which
// needs cgo and gcc; scripts/gpu_check.sh runs it). It is behind a build
// tag because compiling go-nvml prints about a hundred lines of C
// deprecation warnings and needs a C compiler, which no other build of
// loom does. The fake NVML of fake_test.go is compiled against go-nvml's
// nvml.h for the same reason: NVIDIA's layouts, not a copy of them.

// TestDiscoverMatchesGoNVML reads the GPUs through go-nvml as the
// topology package did before it loaded NVML through purego, and requires
// Discover's topology to be the same, field by field.
func TestDiscoverMatchesGoNVML(t *testing.T) {
	want, err := discoverGoNVML()
	if err != nil {
		t.Skipf("no NVML driver (libnvidia-ml.so.1) through go-nvml: %v", err)
	}
	got, err := Discover()
	if err != nil {
		t.Fatalf("go-nvml reads the GPUs, Discover does not: %v", err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Discover read\n%v%+v\ngo-nvml read\n%v%+v", got, got.Devices, want, want.Devices)
	}
	t.Logf("%d GPU(s), the same through go-nvml and purego:\n%v", len(got.Devices), got)
}

// discoverGoNVML is Discover written on go-nvml.
func discoverGoNVML() (*Topology, error) {
	var opts []nvml.LibraryOption
	if p := strings.TrimSpace(os.Getenv(NVMLEnv)); p != "" {
		opts = append(opts, nvml.WithLibraryPath(p))
	}
	lib := nvml.New(opts...)
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvmlInit: %s", lib.ErrorString(ret))
	}
	defer lib.Shutdown()
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvmlDeviceGetCount: %s", lib.ErrorString(ret))
	}
	t := Uniform(n, "")
	t.Source = "nvml"
	handles := make([]nvml.Device, n)
	for i := range n {
		h, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("nvmlDeviceGetHandleByIndex(%d): %s", i, lib.ErrorString(ret))
		}
		handles[i] = h
		d := &t.Devices[i]
		d.Index = i
		d.NVLinkPeers = map[string]int{}
		if name, ret := h.GetName(); ret == nvml.SUCCESS {
			d.Name = name
		}
		if uuid, ret := h.GetUUID(); ret == nvml.SUCCESS {
			d.UUID = uuid
		}
		pci, ret := h.GetPciInfo()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("GPU %d: nvmlDeviceGetPciInfo: %s", i, lib.ErrorString(ret))
		}
		if d.BusID, _ = NormalizeBusID(int8String(pci.BusId[:])); d.BusID == "" {
			d.BusID = int8String(pci.BusId[:])
		}
		for link := 0; link < nvml.NVLINK_MAX_LINKS; link++ {
			state, ret := h.GetNvLinkState(link)
			if ret != nvml.SUCCESS || state != nvml.FEATURE_ENABLED {
				continue
			}
			remote, ret := h.GetNvLinkRemotePciInfo(link)
			if ret != nvml.SUCCESS {
				continue
			}
			peer, err := NormalizeBusID(int8String(remote.BusId[:]))
			if err != nil {
				continue
			}
			d.NVLinkPeers[peer]++
			if kind, ret := h.GetNvLinkRemoteDeviceType(link); ret == nvml.SUCCESS && kind == nvml.NVLINK_DEVICE_TYPE_SWITCH {
				d.SwitchLinks++
			}
		}
	}
	for i := range n {
		for j := i + 1; j < n; j++ {
			l := Link{Path: PathUnknown}
			if level, ret := lib.DeviceGetTopologyCommonAncestor(handles[i], handles[j]); ret == nvml.SUCCESS {
				l.Path = pathOf(int32(level))
			}
			l.NVLinks = nvlinksBetween(&t.Devices[i], &t.Devices[j])
			t.Links[i][j], t.Links[j][i] = l, l
		}
	}
	return t, nil
}

// int8String converts go-nvml's NUL-terminated C char array.
func int8String(b []int8) string {
	out := make([]byte, len(b))
	for i, c := range b {
		out[i] = byte(c)
	}
	return cString(out)
}

// TestGoNVMLReadsFake: go-nvml reads the fake NVML's mixed machine as
// mixedTopology, as Discover does (TestDiscoverFake), so the fake and
// Discover agree with NVIDIA's binding without a GPU.
func TestGoNVMLReadsFake(t *testing.T) {
	f := useFakeNVML(t, 4)
	mixed(f)
	got, err := discoverGoNVML()
	if err != nil {
		t.Fatal(err)
	}
	if want := mixedTopology(); !reflect.DeepEqual(got, want) {
		t.Errorf("go-nvml read\n%v%+v\nwant\n%v%+v", got, got.Devices, want, want.Devices)
	}
}
