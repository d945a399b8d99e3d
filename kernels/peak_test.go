package kernels

import (
	"strings"
	"testing"
)

func TestCPUInfoMHz(t *testing.T) {
	for _, c := range []struct {
		text string
		mhz  float64
		ok   bool
	}{
		{"processor\t: 0\ncpu MHz\t\t: 2445.402\nprocessor\t: 1\ncpu MHz\t\t: 2445.402\n", 2445.402, true},
		{"cpu MHz : 2000\ncpu MHz : 3000\n", 2500, true},
		{"cpu MHz : fast\ncpu MHz: 1000\n", 1000, true},
		{"BogoMIPS : 50.00\n", 0, false}, // arm64 kernels print no clock
		{"", 0, false},
		{"cpu MHz : 0\ncpu MHz : -5\n", 0, false},
	} {
		mhz, ok := cpuinfoMHz(strings.NewReader(c.text))
		if ok != c.ok || mhz != c.mhz {
			t.Errorf("cpuinfoMHz(%q) = %v, %v; want %v, %v", c.text, mhz, ok, c.mhz, c.ok)
		}
	}
}

func TestEstimatePeak(t *testing.T) {
	p := Peak{ISA: "avx2+fma", Cores: 2, FMAUnits: 2, Lanes: 8, MHz: 2500, MHzSource: "assumed"}
	if got, want := p.FLOPS(), 2*2*8*2*2500e6; got != want {
		t.Errorf("FLOPS = %g, want %g", got, want)
	}
	if got, want := p.PerCoreFLOPS(), 2*8*2*2500e6; got != want {
		t.Errorf("PerCoreFLOPS = %g, want %g", got, want)
	}
	if s := p.String(); !strings.Contains(s, "160.0 GFLOP/s") || !strings.Contains(s, "avx2+fma") {
		t.Errorf("String = %q", s)
	}
	e := EstimatePeak()
	t.Logf("this machine: %v", e)
	if e.Cores < 1 || e.FMAUnits < 1 || e.Lanes < 1 || !(e.MHz > 0) || e.ISA == "" || e.MHzSource == "" {
		t.Errorf("EstimatePeak() = %+v: every field must be set", e)
	}
	if e.ISA == "avx2+fma" && (e.FMAUnits != 2 || e.Lanes != 8) {
		t.Errorf("AVX2+FMA assumes 2 FMA units of 8 lanes; got %+v", e)
	}
}
