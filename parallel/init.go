package parallel

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"

	"github.com/b7ea7098/loom/comm"
)

// Init says how a constructor (NewLinear, NewEmbedding, NewLayerNorm,
// NewAttention, NewMLP) fills a new parameter's global value. Every rank
// computes the whole value alike (parameters start Replicate), so an Init
// must be deterministic: Normal draws from a seeded generator, the others
// are fixed. The zero Init means the constructor's default.
type Init struct {
	kind   initKind
	std    float64
	rng    *rand.Rand // Normal: shared by every copy of the Init
	f32    []float32
	f64    []float64
	byName map[string][]float32
}

type initKind int

const (
	initDefault initKind = iota
	initNormal
	initZeros
	initOnes
	initValues
	initByName
)

// initStream is the PCG stream of Normal's generators (and of the default
// weight init); the seed selects the state.
const initStream = 0x9e3779b97f4a7c15

// Normal draws every element from N(0, std²) with a PCG generator seeded
// with seed. Copies of the returned Init share the generator, so one
// Normal given to several constructors draws their parameters one after
// another, in construction order (each parameter row-major): build the
// model in the same order on every rank to give every rank the same
// values. A float32 parameter gets float32(draw·std).
func Normal(std float64, seed uint64) Init {
	return Init{kind: initNormal, std: std, rng: rand.New(rand.NewPCG(seed, initStream))}
}

// Zeros fills every element with 0.
func Zeros() Init { return Init{kind: initZeros} }

// Ones fills every element with 1.
func Ones() Init { return Init{kind: initOnes} }

// Values fills the parameter with data, its row-major global value, which
// must have the parameter's element count and dtype (float32 or float64).
// The data is copied when the parameter is made.
func Values[T float32 | float64](data []T) Init {
	switch d := any(data).(type) {
	case []float32:
		return Init{kind: initValues, f32: d}
	case []float64:
		return Init{kind: initValues, f64: d}
	}
	return Init{kind: initValues}
}

// ByName fills each float32 parameter with values[name], its row-major
// global value, looked up by the parameter's full name (a checkpoint or a
// fixture, such as reference/tiny_gpt.safetensors' init.* tensors). A
// missing name or a wrong length is an error. The data is copied.
func ByName(values map[string][]float32) Init { return Init{kind: initByName, byName: values} }

// defaultWeight is the weight init when none is given: N(0, 0.02²) from a
// generator seeded with the parameter's name (FNV-1a), so that every rank
// draws the same values and differently named parameters differ.
func defaultWeight(name string) Init {
	h := fnv.New64a()
	h.Write([]byte(name)) // a hash.Hash's Write never fails
	return Normal(0.02, h.Sum64())
}

// fill returns the row-major global value of a parameter called name with
// n elements of dtype dt ([]float32 or []float64).
func (in Init) fill(name string, n int, dt comm.DType) (any, error) {
	if dt != comm.Float32 && dt != comm.Float64 {
		return nil, fmt.Errorf("%w: parameter %q: dtype %v; want float32 or float64", ErrInvalid, name, dt)
	}
	f32 := dt == comm.Float32
	mk := func(v float64) any {
		if f32 {
			d := make([]float32, n)
			if v != 0 {
				for i := range d {
					d[i] = float32(v)
				}
			}
			return d
		}
		d := make([]float64, n)
		if v != 0 {
			for i := range d {
				d[i] = v
			}
		}
		return d
	}
	switch in.kind {
	case initZeros:
		return mk(0), nil
	case initOnes:
		return mk(1), nil
	case initNormal:
		if in.rng == nil || in.std < 0 {
			return nil, fmt.Errorf("%w: parameter %q: Normal init with std %v (std must not be negative)", ErrInvalid, name, in.std)
		}
		if f32 {
			d := make([]float32, n)
			for i := range d {
				d[i] = float32(in.rng.NormFloat64() * in.std)
			}
			return d, nil
		}
		d := make([]float64, n)
		for i := range d {
			d[i] = in.rng.NormFloat64() * in.std
		}
		return d, nil
	case initValues:
		switch {
		case f32 && in.f32 != nil && len(in.f32) == n:
			return slices.Clone(in.f32), nil
		case !f32 && in.f64 != nil && len(in.f64) == n:
			return slices.Clone(in.f64), nil
		}
		return nil, fmt.Errorf("%w: parameter %q: given %d float32 or %d float64 values for %d %v elements", ErrInvalid, name, len(in.f32), len(in.f64), n, dt)
	case initByName:
		d, ok := in.byName[name]
		switch {
		case !ok:
			return nil, fmt.Errorf("%w: parameter %q: ByName has no value for it", ErrInvalid, name)
		case len(d) != n:
			return nil, fmt.Errorf("%w: parameter %q: ByName gives %d values for %d elements", ErrInvalid, name, len(d), n)
		case !f32:
			return nil, fmt.Errorf("%w: parameter %q: ByName holds float32 values for a %v parameter", ErrInvalid, name, dt)
		}
		return slices.Clone(d), nil
	}
	return nil, fmt.Errorf("%w: parameter %q: no init", ErrInvalid, name)
}
