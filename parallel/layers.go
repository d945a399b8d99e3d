package parallel

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
)

// Linear is y = x·Wᵀ + b with W stored [out, in] as PyTorch stores it.
//
// Chunks > 1 marks a fused projection whose output features are Chunks
// equal blocks (q|k|v): ForwardChunks returns the blocks separately, and
// tp.ColwiseParallel shards each block rather than the fused dim, so that every
// rank holds matching slices of q, k and v. A chunk-sharded weight is stored
// [Chunks, out/Chunks, in] (bias [Chunks, out/Chunks]); its row-major data is
// the fused [out, in] weight's.
//
// A Linear is a leaf of the module tree (no children). NewLinear names its
// parameters "<name>.weight" and "<name>.bias", name being the module's
// path; tp.Plan patterns match the path ("h.*.mlp.fc"), not the parameter
// names. tp.ColwiseParallel and tp.RowwiseParallel apply to it.
type Linear struct {
	Hooks
	Weight *autograd.Value
	Bias   *autograd.Value // nil: no bias
	Chunks int             // 0 or 1: not fused
}

// Children returns nil: a Linear is a leaf module.
func (l *Linear) Children() []Child { return nil }

// OwnParams returns the weight and, if present, the bias.
func (l *Linear) OwnParams() []*autograd.Value { return []*autograd.Value{l.Weight, l.Bias} }

// SetOwnParams replaces the weight and the bias (see ParamSetter).
func (l *Linear) SetOwnParams(ps []*autograd.Value) error {
	if err := checkSetParams("Linear", l.OwnParams(), ps); err != nil {
		return err
	}
	l.Weight, l.Bias = ps[0], ps[1]
	return nil
}

func (l *Linear) chunks() int { return max(l.Chunks, 1) }

// Forward runs the input hooks, the projection and the output hooks. A
// chunk-sharded weight needs ForwardChunks.
func (l *Linear) Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	if err := l.check(); err != nil {
		return nil, err
	}
	if len(l.Weight.Spec().Shape()) != 2 {
		return nil, fmt.Errorf("%w: Linear.Forward: weight %v is chunk-sharded; use ForwardChunks", ErrInvalid, l.Weight.Spec())
	}
	y, err := l.Run(ctx, x, func(_ context.Context, x *autograd.Value) (*autograd.Value, error) {
		return autograd.Linear(x, l.Weight, l.Bias)
	})
	if err != nil {
		return nil, fmt.Errorf("parallel: Linear: %w", err)
	}
	return y, nil
}

// ForwardChunks runs the input hooks, the fused projection and the output
// hooks on each of its Chunks output blocks, returned in order.
func (l *Linear) ForwardChunks(ctx context.Context, x *autograd.Value) ([]*autograd.Value, error) {
	if err := l.check(); err != nil {
		return nil, err
	}
	if err := l.Enter(ctx); err != nil {
		return nil, fmt.Errorf("parallel: Linear: %w", err)
	}
	x, err := l.Input(ctx, x)
	if err != nil {
		return nil, fmt.Errorf("parallel: Linear input: %w", err)
	}
	var parts []*autograd.Value
	if ws := l.Weight.Spec().Shape(); len(ws) == 2 {
		y, err := autograd.Linear(x, l.Weight, l.Bias)
		if err != nil {
			return nil, fmt.Errorf("parallel: Linear: %w", err)
		}
		if parts, err = autograd.SplitLast(y, l.chunks()); err != nil {
			return nil, fmt.Errorf("parallel: Linear: %w", err)
		}
	} else {
		// [C, O, I]: one projection per block; each block's rows may be
		// sharded (dim 1) while the chunk dim is not.
		for c := range ws[0] {
			w, err := chunk(l.Weight, c)
			if err != nil {
				return nil, err
			}
			var b *autograd.Value
			if l.Bias != nil {
				if b, err = chunk(l.Bias, c); err != nil {
					return nil, err
				}
			}
			y, err := autograd.Linear(x, w, b)
			if err != nil {
				return nil, fmt.Errorf("parallel: Linear chunk %d: %w", c, err)
			}
			parts = append(parts, y)
		}
	}
	for i, p := range parts {
		if parts[i], err = l.Output(ctx, p); err != nil {
			return nil, fmt.Errorf("parallel: Linear output: %w", err)
		}
	}
	return parts, nil
}

// check rejects a nil Linear or one without a weight.
func (l *Linear) check() error {
	if l == nil || l.Weight.Spec() == nil {
		return fmt.Errorf("%w: Linear: nil module or weight", ErrInvalid)
	}
	return nil
}

// chunk returns block c of a [C, ...] value as a [...] value.
func chunk(v *autograd.Value, c int) (*autograd.Value, error) {
	n, err := autograd.Narrow(v, 0, c, 1)
	if err != nil {
		return nil, fmt.Errorf("parallel: Linear chunk %d: %w", c, err)
	}
	r, err := autograd.Reshape(n, v.Spec().Shape()[1:]...)
	if err != nil {
		return nil, fmt.Errorf("parallel: Linear chunk %d: %w", c, err)
	}
	return r, nil
}

// Embedding looks up rows of Table [V, D] by token ids. It is a leaf
// module; NewEmbedding names the table by the module's path itself ("wte").
// tp.RowwiseParallel on it is vocab parallelism (the table Shard(0)).
type Embedding struct {
	Hooks
	Table *autograd.Value
}

// Children returns nil: an Embedding is a leaf module.
func (e *Embedding) Children() []Child { return nil }

// OwnParams returns the table.
func (e *Embedding) OwnParams() []*autograd.Value { return []*autograd.Value{e.Table} }

// SetOwnParams replaces the table (see ParamSetter).
func (e *Embedding) SetOwnParams(ps []*autograd.Value) error {
	if err := checkSetParams("Embedding", e.OwnParams(), ps); err != nil {
		return err
	}
	e.Table = ps[0]
	return nil
}

// Forward looks up ids (shape S; the result is S + [D]) and runs the output
// hooks. Input hooks do not apply: ids are not differentiable values.
func (e *Embedding) Forward(ctx context.Context, ids *autograd.Indices) (*autograd.Value, error) {
	if e == nil {
		return nil, fmt.Errorf("%w: Embedding: nil module", ErrInvalid)
	}
	if err := e.Enter(ctx); err != nil {
		return nil, fmt.Errorf("parallel: Embedding: %w", err)
	}
	y, err := autograd.Embedding(e.Table, ids)
	if err != nil {
		return nil, fmt.Errorf("parallel: Embedding: %w", err)
	}
	if y, err = e.Output(ctx, y); err != nil {
		return nil, fmt.Errorf("parallel: Embedding output: %w", err)
	}
	return y, nil
}

// LayerNorm normalises over the last dim with the biased variance and
// epsilon Eps, then scales by Weight and shifts by Bias (both [D]). It is a
// leaf module; NewLayerNorm names its parameters "<name>.weight" and
// "<name>.bias". tp.SequenceParallel applies to it.
type LayerNorm struct {
	Hooks
	Weight, Bias *autograd.Value
	Eps          float64
}

// Children returns nil: a LayerNorm is a leaf module.
func (n *LayerNorm) Children() []Child { return nil }

// OwnParams returns the weight and the bias.
func (n *LayerNorm) OwnParams() []*autograd.Value { return []*autograd.Value{n.Weight, n.Bias} }

// SetOwnParams replaces the weight and the bias (see ParamSetter).
func (n *LayerNorm) SetOwnParams(ps []*autograd.Value) error {
	if err := checkSetParams("LayerNorm", n.OwnParams(), ps); err != nil {
		return err
	}
	n.Weight, n.Bias = ps[0], ps[1]
	return nil
}

// Forward runs the input hooks, the normalisation and the output hooks.
func (n *LayerNorm) Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	if n == nil {
		return nil, fmt.Errorf("%w: LayerNorm: nil module", ErrInvalid)
	}
	y, err := n.Run(ctx, x, func(_ context.Context, x *autograd.Value) (*autograd.Value, error) {
		return autograd.LayerNorm(x, n.Weight, n.Bias, n.Eps)
	})
	if err != nil {
		return nil, fmt.Errorf("parallel: LayerNorm: %w", err)
	}
	return y, nil
}

// Attention is causal multi-head self-attention with a fused q|k|v
// projection (QKV, Chunks 3) and an output projection (Proj), on x [B, T,
// D] with Heads heads of D/Heads channels. Heads are a tensor dim, so
// sharding QKV colwise and Proj rowwise shards the heads (tensor
// parallelism): each rank then attends with its own heads only.
//
// Its children are "qkv" (QKV) and "proj" (Proj), so the Megatron plan for
// an attention module at path p is {p + ".qkv": tp.ColwiseParallel{}, p +
// ".proj": tp.RowwiseParallel{}}, which needs Heads divisible by the axis
// size. NewAttention builds it.
//
// Core, when set, replaces the one-rank causal attention: context
// parallelism (a sequence dim sharded over a cp axis) sets it to
// parallel/cp's Attention over that axis, which this package cannot
// import.
type Attention struct {
	Hooks
	QKV, Proj *Linear
	Heads     int
	Core      AttentionFunc // nil: autograd.CausalAttention
}

// AttentionFunc is exact causal attention of q, k [B, H, T, Dh] and v [B,
// H, T, Dv], returning [B, H, T, Dv] laid out like q: what Attention.Core
// computes.
type AttentionFunc func(ctx context.Context, q, k, v *autograd.Value) (*autograd.Value, error)

// Children returns qkv and proj.
func (a *Attention) Children() []Child {
	return []Child{{"qkv", a.QKV}, {"proj", a.Proj}}
}

// Forward computes proj(attn(q, k, v)) for x [B, T, D].
func (a *Attention) Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	if a == nil || a.QKV == nil || a.Proj == nil {
		return nil, fmt.Errorf("%w: Attention: nil module, qkv or proj", ErrInvalid)
	}
	if x == nil {
		return nil, nilInput("Attention")
	}
	o, err := a.Run(ctx, x, a.compute)
	if err != nil {
		return nil, fmt.Errorf("parallel: Attention: %w", err)
	}
	return o, nil
}

// compute is the attention of x [B, T, D], after the input hooks.
func (a *Attention) compute(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	sh := x.Spec().Shape()
	if len(sh) != 3 || a.Heads < 1 || sh[2]%a.Heads != 0 {
		return nil, fmt.Errorf("%w: input %v for %d heads; want [B, T, D] with D divisible by the heads", ErrInvalid, sh, a.Heads)
	}
	B, T, D := sh[0], sh[1], sh[2]
	qkv, err := a.QKV.ForwardChunks(ctx, x)
	if err != nil {
		return nil, err
	}
	if len(qkv) != 3 {
		return nil, fmt.Errorf("%w: qkv has %d chunks, want 3", ErrInvalid, len(qkv))
	}
	var heads [3]*autograd.Value
	for i, v := range qkv { // [B,T,D] -> [B,H,T,Dh]
		r, err := autograd.Reshape(v, B, T, a.Heads, D/a.Heads)
		if err != nil {
			return nil, err
		}
		if heads[i], err = autograd.Permute(r, 0, 2, 1, 3); err != nil {
			return nil, err
		}
	}
	core := a.Core
	if core == nil {
		core = func(_ context.Context, q, k, v *autograd.Value) (*autograd.Value, error) {
			return autograd.CausalAttention(q, k, v)
		}
	}
	o, err := core(ctx, heads[0], heads[1], heads[2])
	if err != nil {
		return nil, err
	}
	if o, err = autograd.Permute(o, 0, 2, 1, 3); err != nil {
		return nil, err
	}
	if o, err = autograd.Reshape(o, B, T, D); err != nil {
		return nil, err
	}
	return a.Proj.Forward(ctx, o)
}

// MLP is proj(GELU(fc(x))) with the exact (erf) GELU. Its children are
// "fc" (FC) and "proj" (Proj): the Megatron plan for an MLP at path p is
// {p + ".fc": tp.ColwiseParallel{}, p + ".proj": tp.RowwiseParallel{}}. NewMLP
// builds it.
type MLP struct {
	Hooks
	FC, Proj *Linear
}

// Children returns fc and proj.
func (p *MLP) Children() []Child { return []Child{{"fc", p.FC}, {"proj", p.Proj}} }

// Forward computes proj(GELU(fc(x))).
func (p *MLP) Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	if p == nil || p.FC == nil || p.Proj == nil {
		return nil, fmt.Errorf("%w: MLP: nil module, fc or proj", ErrInvalid)
	}
	y, err := p.Run(ctx, x, func(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
		u, err := p.FC.Forward(ctx, x)
		if err != nil {
			return nil, err
		}
		g, err := autograd.GELU(u)
		if err != nil {
			return nil, err
		}
		return p.Proj.Forward(ctx, g)
	})
	if err != nil {
		return nil, fmt.Errorf("parallel: MLP: %w", err)
	}
	return y, nil
}
