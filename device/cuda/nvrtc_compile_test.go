//go:build linux && (amd64 || arm64)

package cuda

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// nvrtcRequireEnv makes TestNVRTCCompiles fail, instead of skipping, when
// no NVRTC loads: CI installs Debian's libnvrtc11.2 and sets it.
const nvrtcRequireEnv = "LOOM_NVRTC_REQUIRE"

// kernelMarks are the kernels a source marks with LOOM_KERNEL(name), and
// kernelDefs those it defines as extern "C" __global__.
var (
	kernelMarks = regexp.MustCompile(`(?m)^LOOM_KERNEL\((\w+)\)`)
	kernelDefs  = regexp.MustCompile(`extern "C" __global__ void (\w+)\(`)
)

// TestKernelFiles checks KernelFiles against the sources: every kernel a
// file defines is marked and listed, in order, and no name is in two
// files. The emulator and the NVRTC check both go by the list.
func TestKernelFiles(t *testing.T) {
	seen := map[string]string{}
	files := KernelFiles()
	if len(files) == 0 {
		t.Fatal("no kernel files")
	}
	for _, f := range files {
		src := f.Source()
		var marked, defined []string
		for _, m := range kernelMarks.FindAllStringSubmatch(src, -1) {
			marked = append(marked, m[1])
		}
		for _, m := range kernelDefs.FindAllStringSubmatch(src, -1) {
			defined = append(defined, m[1])
		}
		if !slices.Equal(marked, f.Kernels) || !slices.Equal(defined, f.Kernels) {
			t.Errorf("%s: KernelFiles lists %v; the source defines %v and marks %v", f.Name, f.Kernels, defined, marked)
		}
		for _, k := range f.Kernels {
			if other, ok := seen[k]; ok {
				t.Errorf("kernel %s is in %s and %s", k, other, f.Name)
			}
			seen[k] = f.Name
		}
		if !strings.HasPrefix(src, KernelFile{}.Source()) || !strings.Contains(src, "#line 1 \""+f.Name+"\"\n") {
			t.Errorf("%s: the source does not start with the prelude and a #line directive", f.Name)
		}
	}
}

// TestNVRTCCompiles compiles every kernel source with the real NVRTC for
// sm_80 and sm_90 to cubins, and checks that each listed kernel is a symbol
// of the cubin (an ELF file). It needs no GPU or driver. Without NVRTC it
// skips, unless LOOM_NVRTC_REQUIRE=1.
func TestNVRTCCompiles(t *testing.T) {
	l := loadNVRTC(t)
	major, minor, err := l.NVRTCVersion()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("NVRTC %d.%d from %s", major, minor, l.NVRTCPath())
	for _, f := range KernelFiles() {
		for _, arch := range []int{80, 90} {
			p, err := l.Compile(f.Source(), f.Name, CompileOptions{Arch: arch})
			if err != nil {
				var ce *CompileError
				if errors.As(err, &ce) {
					t.Errorf("%s for sm_%d: %v\n%s", f.Name, arch, err, ce.Log)
				} else {
					t.Errorf("%s for sm_%d: %v", f.Name, arch, err)
				}
				continue
			}
			if p.PTX {
				t.Errorf("%s for sm_%d: NVRTC %d.%d gave PTX, not a cubin", f.Name, arch, major, minor)
				continue
			}
			if p.Log != "" {
				t.Errorf("%s for sm_%d: NVRTC warns:\n%s", f.Name, arch, p.Log)
			}
			syms, err := cubinSymbols(p.Image)
			if err != nil {
				t.Errorf("%s for sm_%d: reading the cubin: %v", f.Name, arch, err)
				continue
			}
			for _, k := range f.Kernels {
				if !syms[k] {
					t.Errorf("%s for sm_%d: kernel %s is not a symbol of the cubin", f.Name, arch, k)
				}
			}
		}
	}
}

// TestNVRTCCompileErrorHasLog checks that a kernel file that does not
// compile under the real NVRTC fails with NVRTC's log naming the file and
// line, which the #line directive of KernelFile.Source makes the file's own.
func TestNVRTCCompileErrorHasLog(t *testing.T) {
	l := loadNVRTC(t)
	bad := KernelFile{Name: "bad.cu", text: "extern \"C\" __global__ void k(float *x) {\n  x[0] = undeclared;\n}\n"}
	_, err := l.Compile(bad.Source(), bad.Name, CompileOptions{Arch: 80})
	var ce *CompileError
	if !errors.As(err, &ce) || !strings.Contains(ce.Log, "bad.cu(2)") || !strings.Contains(ce.Log, "undeclared") {
		t.Fatalf("compiling a bad source: %v (want a CompileError whose log names bad.cu(2) and the identifier)", err)
	}
}

// cubinSymbols returns the names of the symbols of an ELF cubin.
func cubinSymbols(image []byte) (map[string]bool, error) {
	// A cubin's e_version (bytes 20-23 of the header) is CUDA's ELF ABI
	// version, not EV_CURRENT, which debug/elf insists on: parse a copy
	// with it set to 1.
	if len(image) < 24 {
		return nil, fmt.Errorf("%d bytes, short of an ELF header", len(image))
	}
	img := slices.Clone(image)
	binary.LittleEndian.PutUint32(img[20:], uint32(elf.EV_CURRENT))
	f, err := elf.NewFile(bytes.NewReader(img))
	if err != nil {
		return nil, err
	}
	syms, err := f.Symbols()
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, s := range syms {
		out[s.Name] = true
	}
	return out, nil
}

// loadNVRTC loads NVRTC alone, or skips when none is found (fails under
// LOOM_NVRTC_REQUIRE=1). Load does not fail without NVRTC; the first call
// that needs it returns the *LoadError.
func loadNVRTC(t *testing.T) *Lib {
	t.Helper()
	l, err := Load(WithDriver(Off))
	if err == nil {
		_, _, err = l.NVRTCVersion()
	}
	if err != nil {
		var le *LoadError
		if errors.As(err, &le) && os.Getenv(nvrtcRequireEnv) != "1" {
			t.Skipf("no NVRTC library (%s=1 makes this a failure): %v", nvrtcRequireEnv, err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}
