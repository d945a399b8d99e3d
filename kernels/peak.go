package kernels

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/cpu"
)

// Peak is an estimate of a CPU's peak single-precision floating-point
// throughput, the ceiling against which a GEMM benchmark reports its
// efficiency:
//
//	FLOPS = Cores × FMAUnits × Lanes × 2 × MHz·10⁶
//
// (an FMA is two floating-point operations). It is an upper bound built
// from nominal figures, not a measurement: turbo clocks, shared SMT cores,
// hypervisor steal and frequency drops under wide vector load all move the
// real ceiling.
type Peak struct {
	// ISA is the widest vector extension used for the estimate: "avx512",
	// "avx2+fma", "avx", "sse2", "neon" or "scalar".
	ISA string
	// Cores is the number of logical CPUs the process may run on
	// (runtime.NumCPU). Where two logical CPUs are SMT siblings of one
	// physical core they share its FMA units, and the estimate is then
	// twice the real peak.
	Cores int
	// FMAUnits is the number of vector FMA pipes per core assumed for the
	// ISA: 2 for AVX-512 and for AVX2+FMA (Intel since Haswell, AMD since
	// Zen 2; Zen 1 and some server parts with one AVX-512 unit have fewer
	// or narrower ones), 2 for NEON, 1 otherwise.
	FMAUnits int
	// Lanes is the number of float32 values in one vector register: 16
	// for AVX-512, 8 for AVX/AVX2, 4 for SSE2 and NEON, 1 for scalar code.
	Lanes int
	// MHz is the clock used, in MHz.
	MHz float64
	// MHzSource says where MHz came from: "/proc/cpuinfo" (the mean "cpu
	// MHz" over its processors, the current clock the kernel reports) or
	// "assumed" (no readable value; 2000 MHz is used).
	MHzSource string
}

// assumedMHz is the clock EstimatePeak uses when none can be read.
const assumedMHz = 2000

// EstimatePeak estimates this machine's peak single-precision FLOP/s from
// the detected ISA, the logical CPU count and the clock in /proc/cpuinfo
// (see [Peak] for the formula and its assumptions). It never fails; a
// clock it cannot read is assumed to be 2000 MHz and MHzSource says so.
func EstimatePeak() Peak {
	p := Peak{Cores: runtime.NumCPU(), MHz: assumedMHz, MHzSource: "assumed"}
	p.ISA, p.FMAUnits, p.Lanes = detectISA()
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		if mhz, ok := cpuinfoMHz(f); ok {
			p.MHz, p.MHzSource = mhz, "/proc/cpuinfo"
		}
		_ = f.Close() // a file opened for reading: closing it loses nothing
	}
	return p
}

// FLOPS is the estimated peak in floating-point operations per second.
func (p Peak) FLOPS() float64 {
	return float64(p.Cores) * float64(p.FMAUnits) * float64(p.Lanes) * 2 * p.MHz * 1e6
}

// PerCoreFLOPS is the estimated peak of one core.
func (p Peak) PerCoreFLOPS() float64 {
	return float64(p.FMAUnits) * float64(p.Lanes) * 2 * p.MHz * 1e6
}

// String describes the estimate, e.g. "avx2+fma: 2 cores × 2 FMA × 8 lanes
// × 2 × 2445 MHz (/proc/cpuinfo) = 156.5 GFLOP/s".
func (p Peak) String() string {
	return fmt.Sprintf("%s: %d cores × %d FMA × %d lanes × 2 × %.0f MHz (%s) = %.1f GFLOP/s",
		p.ISA, p.Cores, p.FMAUnits, p.Lanes, p.MHz, p.MHzSource, p.FLOPS()/1e9)
}

// detectISA returns the widest usable float32 vector ISA with its assumed
// FMA units per core and lanes.
func detectISA() (isa string, fma, lanes int) {
	switch runtime.GOARCH {
	case "amd64":
		switch {
		case cpu.X86.HasAVX512F:
			return "avx512", 2, 16
		case cpu.X86.HasAVX2 && cpu.X86.HasFMA:
			return "avx2+fma", 2, 8
		case cpu.X86.HasAVX:
			// No FMA: a multiply and an add pipe, counted as one FMA.
			return "avx", 1, 8
		}
		return "sse2", 1, 4
	case "arm64":
		return "neon", 2, 4
	}
	return "scalar", 1, 1
}

// cpuinfoMHz returns the mean of the "cpu MHz" lines of a /proc/cpuinfo
// text, and false when there is none.
func cpuinfoMHz(r io.Reader) (float64, bool) {
	sc := bufio.NewScanner(r)
	sum, n := 0.0, 0
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok || strings.TrimSpace(key) != "cpu MHz" {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(val), 64)
		if err != nil || !(v > 0) {
			continue
		}
		sum += v
		n++
	}
	if n == 0 {
		return 0, false
	}
	return sum / float64(n), true
}
