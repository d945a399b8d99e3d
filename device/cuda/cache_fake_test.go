//go:build linux && (amd64 || arm64)

package cuda

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestFakeKernelCache compiles through the on-disk cache with the fake
// NVRTC, which counts its compilations: a second compile of the same
// program is a hit, a change of options, architecture, PTX or NVRTC
// version a miss, a corrupt entry is compiled and stored again, and "off"
// compiles every time.
func TestFakeKernelCache(t *testing.T) {
	lib, fc := buildFake(t)
	dir := filepath.Join(t.TempDir(), "kernels")
	l, err := Load(WithDriver(lib), WithNVRTC(lib), WithKernelCache(dir))
	must(t, err)
	defer func() { must(t, l.Close()) }()
	if l.KernelCache() != dir {
		t.Fatalf("KernelCache() = %q, want %q", l.KernelCache(), dir)
	}
	const src = "extern \"C\" __global__ void k() {}\n"
	// compile compiles o and checks whether NVRTC ran.
	compile := func(what string, o CompileOptions, wantCompiled bool) *Program {
		t.Helper()
		before := fc.compiles()
		p, err := l.Compile(src, "k.cu", o)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if compiled := fc.compiles() != before; compiled != wantCompiled || p.Cached == wantCompiled {
			t.Errorf("%s: NVRTC ran %v, Cached %v; want NVRTC to run %v", what, compiled, p.Cached, wantCompiled)
		}
		if p.CacheErr != nil {
			t.Errorf("%s: CacheErr %v", what, p.CacheErr)
		}
		return p
	}
	files := func() int {
		t.Helper()
		ents, err := os.ReadDir(dir)
		must(t, err)
		return len(ents)
	}

	first := compile("first", CompileOptions{Arch: 90}, true)
	hit := compile("again", CompileOptions{Arch: 90}, false)
	if string(hit.Image) != string(first.Image) || hit.PTX || hit.Options[0] != first.Options[0] {
		t.Errorf("hit %+v differs from the compiled %+v", hit, first)
	}
	compile("extra option", CompileOptions{Arch: 90, Extra: []string{"-lineinfo"}}, true)
	compile("extra option again", CompileOptions{Arch: 90, Extra: []string{"-lineinfo"}}, false)
	compile("architecture", CompileOptions{Arch: 80}, true)
	ptx := compile("PTX", CompileOptions{Arch: 90, PTX: true}, true)
	if !ptx.PTX || string(ptx.Image) != "FAKE compute_90\x00" {
		t.Errorf("PTX program %+v", ptx)
	}
	compile("PTX again", CompileOptions{Arch: 90, PTX: true}, false)
	fc.setNVRTCVersion(12, 6)
	compile("NVRTC version", CompileOptions{Arch: 90}, true)
	fc.setNVRTCVersion(12, 4)
	compile("old NVRTC version again", CompileOptions{Arch: 90}, false)
	if n := files(); n != 5 {
		t.Errorf("%d cache files, want 5", n)
	}
	if m, _ := filepath.Glob(filepath.Join(dir, "*.ptx")); len(m) != 1 {
		t.Errorf("PTX files %q, want one", m)
	}

	// A corrupt entry is deleted, compiled and stored again.
	cubins, _ := filepath.Glob(filepath.Join(dir, "*.cubin"))
	for _, f := range cubins {
		raw, err := os.ReadFile(f)
		must(t, err)
		raw[len(raw)-1] ^= 0xff
		must(t, os.WriteFile(f, raw, 0o644))
	}
	compile("corrupt entry", CompileOptions{Arch: 90}, true)
	compile("after the corrupt entry was replaced", CompileOptions{Arch: 90}, false)

	// A failed compilation stores nothing.
	n := files()
	var ce *CompileError
	if _, err := l.Compile("#error no\n", "bad.cu", CompileOptions{Arch: 90}); !errors.As(err, &ce) {
		t.Errorf("bad source: %v", err)
	}
	if files() != n {
		t.Error("a failed compilation left a cache file")
	}

	// Per context, CompileModule loads a program once.
	c, err := l.Open(0)
	must(t, err)
	before := fc.compiles()
	m1, err := c.CompileModule(src, "k.cu")
	must(t, err)
	m2, err := c.CompileModule(src, "k.cu")
	must(t, err)
	m3, err := c.CompileModule(src, "k.cu", "-DX=1")
	must(t, err)
	if m1 != m2 || m1 == m3 || fc.modules() != 2 || fc.compiles() != before+1 {
		t.Errorf("same module %v, other options same %v; %d modules loaded, %d compilations; want 2 and 1 (the first was cached)",
			m1 == m2, m1 == m3, fc.modules(), fc.compiles()-before)
	}
	if !m1.Program().Cached || m1.Program().Options[0] != "--gpu-architecture=sm_90" {
		t.Errorf("CompileModule's program %+v, want sm_90 from the cache", m1.Program())
	}
	must(t, m1.Close()) // shared: stays loaded
	if fc.modules() != 2 {
		t.Error("Close of a cached module unloaded it")
	}
	must(t, c.Close())
	if fc.modules() != 0 {
		t.Errorf("%d modules loaded after the context closed", fc.modules())
	}
	if _, err := c.CompileModule(src, "k.cu"); !errors.Is(err, ErrInvalid) {
		t.Errorf("CompileModule on a closed context: %v", err)
	}
}

// TestFakeKernelCacheOff: with the cache off every compile runs NVRTC and
// writes nothing; an unusable folder does not fail the compilation but
// says why in CacheErr; the environment chooses the folder.
func TestFakeKernelCacheOff(t *testing.T) {
	lib, fc := buildFake(t)
	home := t.TempDir()
	t.Setenv("XDG_CACHE_HOME", home)
	t.Setenv(KernelCacheEnv, Off)
	l, err := Load(WithDriver(lib), WithNVRTC(lib))
	must(t, err)
	defer func() { must(t, l.Close()) }()
	if l.KernelCache() != "" {
		t.Fatalf("KernelCache() = %q with %s=off", l.KernelCache(), KernelCacheEnv)
	}
	for range 2 {
		p, err := l.Compile("x", "x.cu", CompileOptions{Arch: 90})
		if err != nil || p.Cached {
			t.Fatalf("compile with the cache off: %+v, %v", p, err)
		}
	}
	if fc.compiles() != 2 {
		t.Errorf("%d compilations with the cache off, want 2", fc.compiles())
	}
	if ents, _ := os.ReadDir(home); len(ents) != 0 {
		t.Errorf("the cache off wrote %d entries under the cache home", len(ents))
	}

	blocker := filepath.Join(t.TempDir(), "file")
	must(t, os.WriteFile(blocker, nil, 0o644))
	t.Setenv(KernelCacheEnv, blocker)
	l2, err := Load(WithDriver(lib), WithNVRTC(lib))
	must(t, err)
	defer func() { must(t, l2.Close()) }()
	if l2.KernelCache() != blocker {
		t.Fatalf("KernelCache() = %q, want %s's %q", l2.KernelCache(), KernelCacheEnv, blocker)
	}
	p, err := l2.Compile("x", "x.cu", CompileOptions{Arch: 90})
	if err != nil || p.CacheErr == nil || len(p.Image) == 0 {
		t.Errorf("compile into an unusable cache: %+v, %v; want the program and a CacheErr", p, err)
	}
}
