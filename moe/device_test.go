package moe_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// deviceLayer is the fixture's layer on a tape whose values live on d
// (the host when d is nil): the tokens, the router weight and the experts,
// and a constant G of the tokens' layout for the loss Σ y·G + aux + z.
type deviceLayer struct {
	x, g  *autograd.Value
	layer *moe.Layer
}

func newDeviceLayer(tape *autograd.Tape, m *mesh.Mesh, mc epMesh, fx *epFixture, rcfg moe.RouterConfig, cfg moe.DispatchConfig, d device.Device) (*deviceLayer, error) {
	on := func(v *autograd.Value, err error) (*autograd.Value, error) {
		if err != nil || d == nil {
			return v, err
		}
		dt, err := v.Data().To(d)
		if err != nil {
			return nil, err
		}
		if v.IsLeaf() && v.RequiresGrad() {
			return tape.Param(v.Name(), dt)
		}
		return tape.Constant(dt)
	}
	tok := mc.tokenPlaces()
	x, err := on(epValue(tape, m, "x", []int{fx.n, fx.d}, tok, fx.x, true))
	if err != nil {
		return nil, err
	}
	g, err := on(epValue(tape, m, "G", []int{fx.n, fx.d}, tok, fx.g, false))
	if err != nil {
		return nil, err
	}
	wr, err := on(epValue(tape, m, "Wr", []int{fx.e, fx.d}, replicated(m), fx.wr, true))
	if err != nil {
		return nil, err
	}
	router, err := moe.NewRouter(wr, rcfg)
	if err != nil {
		return nil, err
	}
	ex, err := float32Experts(tape, m, fx)
	if err != nil {
		return nil, err
	}
	ps := ex.OwnParams()
	for i := range ps {
		if ps[i], err = on(ps[i], nil); err != nil {
			return nil, err
		}
	}
	if ex, err = moe.NewExperts("ep", ps[0], ps[1], ps[2], ps[3]); err != nil {
		return nil, err
	}
	return &deviceLayer{x: x, g: g, layer: &moe.Layer{Router: router, Experts: ex, Dispatch: cfg}}, nil
}

// step runs one forward and backward of L = Σ y·G + aux + z and returns
// y, L's local share and the gradients of x, Wr, W1, b1, W2 and b2, all
// copied to the host.
func (dl *deviceLayer) step(ctx context.Context) ([]*placement.DTensor, error) {
	out, err := dl.layer.Forward(ctx, dl.x)
	if err != nil {
		return nil, err
	}
	yg, err := autograd.Mul(out.Y, dl.g)
	if err != nil {
		return nil, err
	}
	task, err := autograd.Sum(yg)
	if err != nil {
		return nil, err
	}
	loss, err := out.AddLosses(task)
	if err != nil {
		return nil, err
	}
	res := []*placement.DTensor{out.Y.Data(), loss.Data(), out.Routing.Gates.Data()}
	if err := loss.Tape().Backward(ctx, loss); err != nil {
		return nil, err
	}
	for _, v := range append([]*autograd.Value{dl.x}, dl.layer.OwnParams()...) {
		res = append(res, v.Grad())
	}
	for i, r := range res {
		if r == nil {
			return nil, fmt.Errorf("result %d: no gradient", i)
		}
		if res[i], err = r.To(device.Host()); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// sameBits compares two host tensors' local blocks bit for bit.
func sameBits(got, want *placement.DTensor) error {
	g, ok1 := got.LocalData().([]float32)
	w, ok2 := want.LocalData().([]float32)
	if !ok1 || !ok2 || len(g) != len(w) {
		return fmt.Errorf("blocks %T (%v) and %T (%v)", got.LocalData(), got.LocalShape(), want.LocalData(), want.LocalShape())
	}
	for i := range w {
		if math.Float32bits(g[i]) != math.Float32bits(w[i]) {
			return fmt.Errorf("element %d: %v on the device, %v on the host", i, g[i], w[i])
		}
	}
	return nil
}

// TestLayerOnDevice runs the fixture's layer (router with both losses,
// dispatch, experts, combine, and their backward) on the emulated device
// and on the host, three steps on recycling tapes, and compares y, the
// loss, the gates and every gradient bit for bit: the emulated device runs
// the host's CPU kernels on the same data in the same order, so any
// difference means the device path reordered or dropped work. The
// device's driver allocations stay flat after the first step. Meshes and
// configurations cover one rank, the all-to-all-v with regrouping, the
// split payload (several local experts), a data-parallel axis, a
// replicated axis, padding to capacity and diagnostics (the barriers and,
// with padding, the count exchange). The host runs the fused path where it
// would (all but "ep=2"), which gives the all-to-all-v's results.
func TestLayerOnDevice(t *testing.T) {
	fx := epLoadFixture(t)
	base := moe.RouterConfig{K: fx.k, Renormalize: true, AuxCoef: fx.alpha, ZCoef: fx.beta}
	capped := base
	capped.CapacityFactor, capped.PadToCapacity = 1.25, true
	for _, tc := range []struct {
		name  string
		mc    epMesh
		rcfg  moe.RouterConfig
		split int  // moe.SetSplitMinBytes; 0: default
		diag  bool // DispatchConfig.Diagnostics
	}{
		{"ep=1", epMesh{"ep=1", []int{1}, []string{"ep"}}, base, 0, false},
		{"ep=2", epMesh{"ep=2", []int{2}, []string{"ep"}}, base, -1, false},
		{"ep=2/split", epMesh{"ep=2", []int{2}, []string{"ep"}}, base, 1, false},
		{"dp=2,ep=2", epMesh{"dp=2,ep=2", []int{2, 2}, []string{"dp", "ep"}}, base, 0, false},
		{"ep=2,tp=2", epMesh{"ep=2,tp=2", []int{2, 2}, []string{"ep", "tp"}}, base, 0, false},
		{"ep=4/capacity", epMesh{"ep=4", []int{4}, []string{"ep"}}, capped, 0, false},
		{"ep=4/capacity+diag", epMesh{"ep=4", []int{4}, []string{"ep"}}, capped, 0, true},
		{"ep=2/diag", epMesh{"ep=2", []int{2}, []string{"ep"}}, base, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			placementtest.Run(t, tc.mc.shape, tc.mc.names, func(ctx context.Context, m *mesh.Mesh) error {
				d, err := emu.New(m.Rank())
				if err != nil {
					return err
				}
				defer d.Close()
				var layers [2]*deviceLayer
				for i, dev := range []device.Device{nil, d} {
					ws := new(moe.Workspace)
					if tc.split != 0 {
						moe.SetSplitMinBytes(ws, tc.split)
					}
					tape := autograd.NewTape(autograd.WithRecycling(), autograd.WithDevice(dev))
					cfg := moe.DispatchConfig{Axis: "ep", Workspace: ws, Diagnostics: tc.diag, Collectives: dev == nil && tc.name == "ep=2"}
					if layers[i], err = newDeviceLayer(tape, m, tc.mc, fx, tc.rcfg, cfg, dev); err != nil {
						return fmt.Errorf("device %v: %w", dev, err)
					}
				}
				names := []string{"y", "loss", "gates", "dx", "dWr", "dW1", "db1", "dW2", "db2"}
				var allocs int64
				for step := range 3 {
					var res [2][]*placement.DTensor
					for i, l := range layers {
						if res[i], err = l.step(ctx); err != nil {
							return fmt.Errorf("step %d, layer %d: %w", step, i, err)
						}
						l.x.Tape().Recycle()
					}
					for j, name := range names {
						if err := sameBits(res[1][j], res[0][j]); err != nil {
							return fmt.Errorf("step %d: %s: %w", step, name, err)
						}
					}
					// On the recycling tapes the next gradients reuse these.
					for _, l := range layers {
						for _, v := range append([]*autograd.Value{l.x}, l.layer.OwnParams()...) {
							v.ZeroGrad()
						}
					}
					if err := d.Synchronize(); err != nil {
						return err
					}
					st := d.Memory().Stats()
					if step == 0 {
						allocs = st.DriverAllocs
					} else if st.DriverAllocs != allocs {
						return fmt.Errorf("step %d: %d driver allocations, %d after the first step", step, st.DriverAllocs, allocs)
					}
				}
				return nil
			})
		})
	}
}

// TestLayerOnDeviceRejects: float64 tokens on a device are
// ErrUnsupported naming the device (the device path is float32), and
// tokens on a device given host weights are autograd's mixed-device error.
func TestLayerOnDeviceRejects(t *testing.T) {
	fx := epLoadFixture(t)
	rcfg := moe.RouterConfig{K: fx.k, Renormalize: true}
	placementtest.Run(t, []int{1}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		mc := epMesh{"ep=1", []int{1}, []string{"ep"}}
		tape := autograd.NewTape()
		host, err := newDeviceLayer(tape, m, mc, fx, rcfg, moe.DispatchConfig{Axis: "ep"}, nil)
		if err != nil {
			return err
		}
		xd, err := host.x.Data().To(d)
		if err != nil {
			return err
		}
		x, err := tape.Constant(xd)
		if err != nil {
			return err
		}
		if _, err := host.layer.Forward(ctx, x); !errors.Is(err, device.ErrMixed) {
			return fmt.Errorf("tokens on %s, weights on the host: %v, want device.ErrMixed", d.Name(), err)
		}
		x64, err := epValue(tape, m, "x64", []int{fx.n, fx.d}, mc.tokenPlaces(), f64(fx.x), false)
		if err != nil {
			return err
		}
		xd64, err := x64.Data().To(d)
		if err != nil {
			return err
		}
		if x64, err = tape.Constant(xd64); err != nil {
			return err
		}
		r := &moe.Routing{NumExperts: fx.e, K: 1, Experts: make([]int32, fx.n)}
		_, _, err = moe.Dispatch(ctx, x64, r, moe.DispatchConfig{Axis: "ep"})
		if !errors.Is(err, moe.ErrUnsupported) || !errors.Is(err, loom.ErrUnsupported) || !strings.Contains(err.Error(), d.Name()) {
			return fmt.Errorf("float64 tokens on %s: %v, want ErrUnsupported naming the device", d.Name(), err)
		}
		return nil
	})
}
