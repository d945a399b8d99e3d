package train

import (
	"errors"
	"fmt"
	"math"

	"github.com/b7ea7098/loom/internal/numcheck"
)

// Schedule gives the learning rate of optimizer step step, counted from
// 0 (the first update uses Schedule(0)).
type Schedule func(step int) float64

// Constant returns the schedule that is lr at every step. lr must be
// finite and non-negative; errors wrap ErrInvalid.
func Constant(lr float64) (Schedule, error) {
	if err := numcheck.NonNegative(ErrInvalid, "learning rate", lr); err != nil {
		return nil, fmt.Errorf("train: Constant: %w", err)
	}
	return func(int) float64 { return lr }, nil
}

// WarmupCosine returns linear warmup from 0 to peak over warmup steps,
// then cosine decay from peak to floor at step total and floor after it:
//
//	step < warmup:  peak·step/warmup
//	otherwise:      floor + (peak−floor)·½(1 + cos(π·min(1, (step−warmup)/(total−warmup))))
//
// which with floor 0 is Hugging Face's get_cosine_schedule_with_warmup
// (a LambdaLR over PyTorch's optimizer) and, after the warmup, PyTorch's
// CosineAnnealingLR with T_max = total−warmup and eta_min = floor.
// peak and floor must be finite, 0 ≤ floor ≤ peak, 0 ≤ warmup < total;
// errors wrap ErrInvalid.
func WarmupCosine(peak, floor float64, warmup, total int) (Schedule, error) {
	if err := checkDecay("WarmupCosine", peak, floor, warmup, total); err != nil {
		return nil, err
	}
	return func(step int) float64 {
		if step < warmup {
			return peak * float64(step) / float64(warmup)
		}
		p := min(1, float64(step-warmup)/float64(total-warmup))
		return floor + (peak-floor)*0.5*(1+math.Cos(math.Pi*p))
	}, nil
}

// WarmupLinear returns linear warmup from 0 to peak over warmup steps,
// then linear decay from peak to floor at step total and floor after it:
//
//	step < warmup:  peak·step/warmup
//	otherwise:      floor + (peak−floor)·max(0, (total−step)/(total−warmup))
//
// which with floor 0 is Hugging Face's get_linear_schedule_with_warmup
// and, with warmup 0, PyTorch's LinearLR(start_factor 1, end_factor
// floor/peak, total_iters total). Arguments as WarmupCosine's.
func WarmupLinear(peak, floor float64, warmup, total int) (Schedule, error) {
	if err := checkDecay("WarmupLinear", peak, floor, warmup, total); err != nil {
		return nil, err
	}
	return func(step int) float64 {
		if step < warmup {
			return peak * float64(step) / float64(warmup)
		}
		f := max(0, float64(total-step)/float64(total-warmup))
		return floor + (peak-floor)*f
	}, nil
}

func checkDecay(op string, peak, floor float64, warmup, total int) error {
	errs := []error{
		numcheck.NonNegative(ErrInvalid, "peak", peak),
		numcheck.NonNegative(ErrInvalid, "floor", floor),
		numcheck.NonNegativeCount(ErrInvalid, "warmup", warmup),
	}
	if floor > peak {
		errs = append(errs, fmt.Errorf("%w: floor %v above peak %v", ErrInvalid, floor, peak))
	}
	if total <= warmup {
		errs = append(errs, fmt.Errorf("%w: total %d steps; want more than the %d warmup steps", ErrInvalid, total, warmup))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("train: %s: %w", op, err)
	}
	return nil
}
