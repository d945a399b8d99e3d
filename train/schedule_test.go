package train

import (
	"errors"
	"math"
	"testing"
)

// TestSchedules checks the schedules against their closed forms at
// chosen steps, and against values from PyTorch's formulas: Hugging
// Face's get_cosine_schedule_with_warmup and
// get_linear_schedule_with_warmup (LambdaLR factors times the base LR),
// and CosineAnnealingLR's closed form eta_min + (base−eta_min)(1 +
// cos(π·t/T_max))/2 after the warmup.
func TestSchedules(t *testing.T) {
	cos := func(peak, floor float64, warm, total int) Schedule {
		s, err := WarmupCosine(peak, floor, warm, total)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	lin := func(peak, floor float64, warm, total int) Schedule {
		s, err := WarmupLinear(peak, floor, warm, total)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	c, err := Constant(3e-4)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []struct {
		name string
		s    Schedule
		step int
		want float64
	}{
		{"constant 0", c, 0, 3e-4},
		{"constant 1e6", c, 1_000_000, 3e-4},
		// HF cosine, peak 1, warmup 10, total 110: lambda(step).
		{"cos warmup start", cos(1, 0, 10, 110), 0, 0},
		{"cos warmup", cos(1, 0, 10, 110), 5, 0.5},
		{"cos peak", cos(1, 0, 10, 110), 10, 1},
		{"cos quarter", cos(1, 0, 10, 110), 35, 0.5 * (1 + math.Cos(math.Pi/4))},
		{"cos half", cos(1, 0, 10, 110), 60, 0.5},
		{"cos end", cos(1, 0, 10, 110), 110, 0},
		{"cos after end", cos(1, 0, 10, 110), 500, 0},
		// CosineAnnealingLR(T_max 100, eta_min 0.1) from base 2, no warmup.
		{"annealing t=25", cos(2, 0.1, 0, 100), 25, 0.1 + 1.9*(1+math.Cos(math.Pi*0.25))/2},
		{"annealing t=100", cos(2, 0.1, 0, 100), 100, 0.1},
		// HF linear, peak 1, warmup 4, total 24.
		{"lin warmup", lin(1, 0, 4, 24), 1, 0.25},
		{"lin peak", lin(1, 0, 4, 24), 4, 1},
		{"lin mid", lin(1, 0, 4, 24), 14, 0.5},
		{"lin end", lin(1, 0, 4, 24), 24, 0},
		{"lin after", lin(1, 0, 4, 24), 30, 0},
		// LinearLR(start 1, end 0.25, total_iters 8) from base 4: 4·(1 − 0.75·t/8).
		{"linearLR t=2", lin(4, 1, 0, 8), 2, 4 * (1 - 0.75*2/8)},
		{"linearLR t=8", lin(4, 1, 0, 8), 8, 1},
	} {
		if got := k.s(k.step); math.Abs(got-k.want) > 1e-12 {
			t.Errorf("%s: step %d: %v, want %v", k.name, k.step, got, k.want)
		}
	}
}

func TestSchedulesReject(t *testing.T) {
	for _, c := range []struct {
		name        string
		peak, floor float64
		warm, total int
	}{
		{"negative peak", -1, 0, 0, 10},
		{"floor above peak", 1, 2, 0, 10},
		{"NaN", math.NaN(), 0, 0, 10},
		{"negative warmup", 1, 0, -1, 10},
		{"total within warmup", 1, 0, 10, 10},
	} {
		if _, err := WarmupCosine(c.peak, c.floor, c.warm, c.total); !errors.Is(err, ErrInvalid) {
			t.Errorf("WarmupCosine %s: %v", c.name, err)
		}
		if _, err := WarmupLinear(c.peak, c.floor, c.warm, c.total); !errors.Is(err, ErrInvalid) {
			t.Errorf("WarmupLinear %s: %v", c.name, err)
		}
	}
	if _, err := Constant(math.Inf(1)); !errors.Is(err, ErrInvalid) {
		t.Errorf("Constant(+Inf): %v", err)
	}
}
