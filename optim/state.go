package optim

import (
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// State dicts. An optimizer's state is named by its parameters' names
// (autograd.Value.Name, the names a model's state dict uses), so that a
// checkpoint of it loads into another layout of the same model: each
// piece of per-parameter state is a distributed tensor with the
// parameter's spec (its placements, shards and device), holding this
// rank's block, the memory the optimizer updates. Saving such a tensor
// writes the shards as they lie (an FSDP-sharded moment is written by the
// rank that holds it, never gathered), and loading one fills it in place.

// AdamW's hyper-parameter entries, under the state dict's prefix.
const (
	keyLR          = "lr"
	keyWeightDecay = "weight_decay"
	keyBeta1       = "beta1"
	keyBeta2       = "beta2"
	keyEps         = "eps"
)

// StateDict returns AdamW's state with every name under prefix (for
// example "optim."), for a checkpoint: for each parameter n the moments
// as tensors prefix+n+".exp_avg" and prefix+n+".exp_avg_sq" (PyTorch's
// names) and its update count as the int64 entry prefix+n+".step", and
// the hyper-parameters as float64 entries prefix+"lr", "weight_decay",
// "beta1", "beta2" and "eps". The tensors have the parameter's spec and
// share the moments' memory (host slices or device buffers), so that a
// save writes this rank's shards and a load (checkpoint.LoadInto) fills
// them in place before LoadStateDict.
//
// Moments that do not exist yet (before a parameter's first update) are
// made now, zero, where the parameter lives: zero moments with a step
// count of 0 are where the first update starts, so no result changes
// (PyTorch's distributed checkpoint likewise initialises the state before
// loading). Errors wrap ErrInvalid (after Close; a parameter without a
// name, or two with one name) or are the device's allocation error, which
// leaves nothing allocated.
func (o *AdamW) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	const op = "AdamW.StateDict"
	if o.closed {
		return nil, nil, errClosed(op)
	}
	if err := uniqueNames(op, o.params); err != nil {
		return nil, nil, err
	}
	var made []int
	for i, p := range o.params {
		st := &o.state[i]
		if st.m != nil {
			continue
		}
		m, err := newState(p.Data(), true)
		var v any
		if err == nil {
			if v, err = newState(p.Data(), true); err != nil {
				err = errors.Join(err, freeState(m))
			}
		}
		if err != nil {
			for _, j := range made {
				err = errors.Join(err, freeState(o.state[j].m), freeState(o.state[j].v))
				o.state[j].m, o.state[j].v = nil, nil
			}
			return nil, nil, fmt.Errorf("optim: %s: the moments of %q on %s: %w", op, p.Name(), p.Data().Device().Name(), err)
		}
		st.m, st.v = m, v
		made = append(made, i)
	}
	tensors := make(map[string]*placement.DTensor, 2*len(o.params))
	entries := map[string]any{
		prefix + keyLR: o.LR, prefix + keyWeightDecay: o.WeightDecay,
		prefix + keyBeta1: o.Beta1, prefix + keyBeta2: o.Beta2, prefix + keyEps: o.Eps,
	}
	for i, p := range o.params {
		st := o.state[i]
		m, err := stateTensor(p, st.m)
		if err != nil {
			return nil, nil, fmt.Errorf("optim: %s: %q: %w", op, p.Name(), err)
		}
		v, err := stateTensor(p, st.v)
		if err != nil {
			return nil, nil, fmt.Errorf("optim: %s: %q: %w", op, p.Name(), err)
		}
		tensors[prefix+p.Name()+".exp_avg"] = m
		tensors[prefix+p.Name()+".exp_avg_sq"] = v
		entries[prefix+p.Name()+".step"] = int64(st.t)
	}
	return tensors, entries, nil
}

// LoadStateDict sets AdamW's step counts and hyper-parameters from
// entries (a loaded checkpoint's, by full name, as StateDict named them
// under prefix); the moments are the tensors StateDict returned, which
// the checkpoint filled in place. A missing entry, one of another type,
// a negative step count or hyper-parameters NewAdamW would refuse are
// errors wrapping ErrInvalid, naming the entry, and change nothing.
func (o *AdamW) LoadStateDict(prefix string, entries map[string]any) error {
	const op = "AdamW.LoadStateDict"
	if o.closed {
		return errClosed(op)
	}
	hyper := make([]float64, 5)
	for i, k := range []string{keyLR, keyWeightDecay, keyBeta1, keyBeta2, keyEps} {
		v, err := entryOf[float64](op, entries, prefix+k)
		if err != nil {
			return err
		}
		hyper[i] = v
	}
	steps := make([]int, len(o.params))
	for i, p := range o.params {
		t, err := entryOf[int64](op, entries, prefix+p.Name()+".step")
		if err != nil {
			return err
		}
		if t < 0 {
			return fmt.Errorf("optim: %s: %w: entry %q is %d, a negative step count", op, ErrInvalid, prefix+p.Name()+".step", t)
		}
		steps[i] = int(t)
	}
	probe := *o
	probe.LR, probe.WeightDecay, probe.Beta1, probe.Beta2, probe.Eps = hyper[0], hyper[1], hyper[2], hyper[3], hyper[4]
	if err := probe.check(op); err != nil {
		return err
	}
	o.LR, o.WeightDecay, o.Beta1, o.Beta2, o.Eps = probe.LR, probe.WeightDecay, probe.Beta1, probe.Beta2, probe.Eps
	for i, t := range steps {
		o.state[i].t = t
	}
	return nil
}

// SGD's hyper-parameter entries, under the state dict's prefix.
const (
	keyMomentum  = "momentum"
	keyDampening = "dampening"
	keyNesterov  = "nesterov"
	keyMaximize  = "maximize"
)

// StateDict returns SGD's state with every name under prefix, for a
// checkpoint: with Momentum ≠ 0, each parameter n's momentum buffer as the
// tensor prefix+n+".momentum_buffer" (the parameter's spec, sharing the
// buffer's memory) and whether it has started as the bool entry
// prefix+n+".has_momentum_buffer" (a buffer that has not is set to the
// gradient by the next update, as PyTorch's None buffer); and the
// hyper-parameters as entries prefix+"lr", "momentum", "dampening",
// "weight_decay" (float64), "nesterov" and "maximize" (bool). Buffers not
// made yet are made now (zero, not started), which changes no result.
// Errors as AdamW.StateDict's.
func (o *SGD) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	const op = "SGD.StateDict"
	if o.closed {
		return nil, nil, errClosed(op)
	}
	if err := uniqueNames(op, o.params); err != nil {
		return nil, nil, err
	}
	entries := map[string]any{
		prefix + keyLR: o.LR, prefix + keyMomentum: o.Momentum, prefix + keyDampening: o.Dampening,
		prefix + keyWeightDecay: o.WeightDecay, prefix + keyNesterov: o.Nesterov, prefix + keyMaximize: o.Maximize,
	}
	tensors := map[string]*placement.DTensor{}
	if o.Momentum == 0 {
		return tensors, entries, nil
	}
	if o.unset == nil {
		o.unset = make([]bool, len(o.params))
	}
	var made []int
	for i, p := range o.params {
		if o.bufs[i] != nil {
			continue
		}
		b, err := newState(p.Data(), true)
		if err != nil {
			for _, j := range made {
				err = errors.Join(err, freeState(o.bufs[j]))
				o.bufs[j], o.unset[j] = nil, false
			}
			return nil, nil, fmt.Errorf("optim: %s: the momentum buffer of %q on %s: %w", op, p.Name(), p.Data().Device().Name(), err)
		}
		o.bufs[i], o.unset[i] = b, true
		made = append(made, i)
	}
	for i, p := range o.params {
		b, err := stateTensor(p, o.bufs[i])
		if err != nil {
			return nil, nil, fmt.Errorf("optim: %s: %q: %w", op, p.Name(), err)
		}
		tensors[prefix+p.Name()+".momentum_buffer"] = b
		entries[prefix+p.Name()+".has_momentum_buffer"] = !o.unset[i]
	}
	return tensors, entries, nil
}

// LoadStateDict sets SGD's hyper-parameters and which momentum buffers
// have started from entries (a loaded checkpoint's, named as StateDict
// named them under prefix); the buffers are the tensors StateDict
// returned, which the checkpoint filled in place. Call StateDict first,
// with the Momentum the checkpoint was saved with: a checkpoint saved
// with momentum holds buffers that one saved without does not. Missing
// entries, entries of another type or hyper-parameters NewSGD would
// refuse are errors wrapping ErrInvalid, naming the entry, and change
// nothing.
func (o *SGD) LoadStateDict(prefix string, entries map[string]any) error {
	const op = "SGD.LoadStateDict"
	if o.closed {
		return errClosed(op)
	}
	probe := *o
	for k, dst := range map[string]*float64{keyLR: &probe.LR, keyMomentum: &probe.Momentum, keyDampening: &probe.Dampening, keyWeightDecay: &probe.WeightDecay} {
		v, err := entryOf[float64](op, entries, prefix+k)
		if err != nil {
			return err
		}
		*dst = v
	}
	for k, dst := range map[string]*bool{keyNesterov: &probe.Nesterov, keyMaximize: &probe.Maximize} {
		v, err := entryOf[bool](op, entries, prefix+k)
		if err != nil {
			return err
		}
		*dst = v
	}
	if err := probe.check(op); err != nil {
		return err
	}
	var unset []bool
	if probe.Momentum != 0 {
		unset = make([]bool, len(o.params))
		for i, p := range o.params {
			if o.bufs[i] == nil {
				return fmt.Errorf("optim: %s: %w: %q has no momentum buffer to load into: call StateDict first, with the checkpoint's momentum (%v)", op, ErrInvalid, p.Name(), probe.Momentum)
			}
			has, err := entryOf[bool](op, entries, prefix+p.Name()+".has_momentum_buffer")
			if err != nil {
				return err
			}
			unset[i] = !has
		}
	}
	o.LR, o.Momentum, o.Dampening, o.WeightDecay = probe.LR, probe.Momentum, probe.Dampening, probe.WeightDecay
	o.Nesterov, o.Maximize = probe.Nesterov, probe.Maximize
	if unset != nil {
		o.unset = unset
	}
	return nil
}

// stateTensor wraps a piece of p's optimizer state (its local block's
// shape, where p lives) as a distributed tensor with p's spec, sharing
// its memory.
func stateTensor(p *autograd.Value, s any) (*placement.DTensor, error) {
	spec := p.Data().Spec()
	if b, ok := s.(device.Buffer); ok {
		return placement.NewLocalOn(spec, b)
	}
	return placement.NewLocal(spec, s)
}

// uniqueNames checks that every parameter has a name of its own, which a
// state dict keys its state by.
func uniqueNames(op string, params []*autograd.Value) error {
	seen := make(map[string]int, len(params))
	for i, p := range params {
		n := p.Name()
		if n == "" {
			return fmt.Errorf("optim: %s: %w: parameter %d has no name (a state dict keys the state by name)", op, ErrInvalid, i)
		}
		if j, ok := seen[n]; ok {
			return fmt.Errorf("optim: %s: %w: parameters %d and %d are both named %q", op, ErrInvalid, j, i, n)
		}
		seen[n] = i
	}
	return nil
}

// entryOf returns entries[name] as a T, or an error wrapping ErrInvalid
// that names the entry.
func entryOf[T any](op string, entries map[string]any, name string) (T, error) {
	var zero T
	v, ok := entries[name]
	if !ok {
		keys := len(entries)
		return zero, fmt.Errorf("optim: %s: %w: no entry %q among the %d loaded", op, ErrInvalid, name, keys)
	}
	t, ok := v.(T)
	if !ok {
		return zero, fmt.Errorf("optim: %s: %w: entry %q is %T, want %T", op, ErrInvalid, name, v, zero)
	}
	return t, nil
}
