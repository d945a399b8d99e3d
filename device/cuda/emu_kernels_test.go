//go:build linux && (amd64 || arm64)

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/internal/dynlib"
	"github.com/b7ea7098/loom/internal/half"
	"github.com/b7ea7098/loom/kernels"
)

// These tests run the kernel sources on the CPU: testdata/loom_emu.h
// defines the CUDA built-ins (threads as fibers, with real barriers and
// warp shuffles), g++ compiles it with the text of every KernelFile.Source
// into a shared library, and each kernel, launched by name with Go slices
// as device memory, is checked against the CPU kernel of package kernels
// it replaces, on small and odd shapes and several launch geometries (one
// block, so grid-stride loops wrap; more blocks than work). They skip
// without g++. What they cannot see is the GPU's own arithmetic: expf,
// erfcf and friends are the host's here (a few ulp apart on the device),
// which the tolerances leave room for where a kernel evaluates them.

// emuSelfTest are kernels of the harness's own tests, compiled with the
// kernel files: barrier and shuffle semantics, and launches the emulator
// must refuse.
const emuSelfTest = `
extern "C" __global__ void emu_barrier(int *order, int *down, int *xr, int *sw) {
  // Outputs by global thread; shared values depend on the block, so a
  // value left by the previous block is wrong.
  const unsigned g = blockIdx.x * blockDim.x + threadIdx.x, k = 1000 * blockIdx.x;
  __shared__ int s[1024];
  s[threadIdx.x] = 3 * threadIdx.x + k;
  __syncthreads();
  order[g] = s[(threadIdx.x + 1) % blockDim.x];
  down[g] = __shfl_down_sync(0xffffffffu, (int)threadIdx.x, 5);
  xr[g] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 9);
  __shared__ int w[1024];
  w[threadIdx.x] = 7 * threadIdx.x + k;
  __syncwarp();
  const unsigned base = threadIdx.x & ~31u;
  sw[g] = w[base + ((threadIdx.x + 1) & 31u)];
}
LOOM_KERNEL(emu_barrier)
extern "C" __global__ void emu_divergent(int *x) {
  if (threadIdx.x == 0) return;
  __syncthreads();
  x[threadIdx.x] = 1;
}
LOOM_KERNEL(emu_divergent)
extern "C" __global__ void emu_shfl(int *x) { x[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1, 1); }
LOOM_KERNEL(emu_shfl)
`

// emuLib is the emulator's C entry points.
type emuLib struct {
	launch  func(name string, gx, gy, gz, bx, by, bz, smem uint32, args unsafe.Pointer, nargs int32) int32
	errText func() string
	has     func(name string) int32
}

// buildEmu compiles the emulator with every kernel file and loads it; it
// skips the test when there is no g++.
func buildEmu(t *testing.T) *emuLib {
	t.Helper()
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Skip("no g++ to compile the kernels for the emulator: ", err)
	}
	dir := t.TempDir()
	var src strings.Builder
	src.WriteString("#include \"loom_emu.h\"\n")
	for _, f := range KernelFiles() {
		src.WriteString(f.Source())
		src.WriteString("\n")
	}
	src.WriteString("#line 1 \"emu_selftest\"\n" + emuSelfTest)
	entry := filepath.Join(dir, "emu.cpp")
	if err := os.WriteFile(entry, []byte(src.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	abs, err := filepath.Abs("testdata")
	if err != nil {
		t.Fatal(err)
	}
	lib := filepath.Join(dir, "libloomemu.so")
	cmd := exec.Command(cxx, "-std=c++20", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wno-unused-variable",
		"-I", abs, "-o", lib, entry)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("compiling the kernels for the emulator: %v\n%s", err, out)
	}
	dl, err := dynlib.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	e := &emuLib{}
	if err := dl.Bind([]dynlib.Symbol{
		{Name: "loom_emu_launch", Fn: &e.launch}, {Name: "loom_emu_error", Fn: &e.errText}, {Name: "loom_emu_has", Fn: &e.has},
	}); err != nil {
		t.Fatal(err)
	}
	return e
}

// dims is the size of a grid or a block.
type dims struct{ x, y, z uint32 }

// d1 is a 1-D size.
func d1(x uint32) dims { return dims{x, 1, 1} }

// run launches kernel name. Slices are passed as device pointers (nil or
// empty: a null pointer), int32, int64, float32 and float64 as C's int,
// long long, float and double, uint64 as unsigned long long.
func (e *emuLib) run(name string, grid, block dims, smem uint32, args ...any) error {
	var pin runtime.Pinner
	defer pin.Unpin()
	vals := make([]uint64, len(args)+1)
	argv := make([]unsafe.Pointer, len(args)+1)
	pin.Pin(&vals[0])
	pin.Pin(&argv[0])
	for i, a := range args {
		switch v := a.(type) {
		case []float32:
			vals[i] = devPtr(&pin, v)
		case []float64:
			vals[i] = devPtr(&pin, v)
		case []uint16:
			vals[i] = devPtr(&pin, v)
		case []int32:
			vals[i] = devPtr(&pin, v)
		case []int64:
			vals[i] = devPtr(&pin, v)
		case int32:
			vals[i] = uint64(uint32(v))
		case int64:
			vals[i] = uint64(v)
		case uint64:
			vals[i] = v
		case float32:
			vals[i] = uint64(math.Float32bits(v))
		case float64:
			vals[i] = math.Float64bits(v)
		default:
			return fmt.Errorf("launching %s: argument %d has the unsupported type %T", name, i, a)
		}
		argv[i] = unsafe.Pointer(&vals[i])
	}
	rc := e.launch(name, grid.x, grid.y, grid.z, block.x, block.y, block.z, smem, unsafe.Pointer(&argv[0]), int32(len(args)))
	runtime.KeepAlive(args)
	if rc != 0 {
		return fmt.Errorf("launching %s: emulator code %d: %s", name, rc, e.errText())
	}
	return nil
}

// devPtr pins s and returns its address, or 0 for an empty slice.
func devPtr[T any](pin *runtime.Pinner, s []T) uint64 {
	if len(s) == 0 {
		return 0
	}
	pin.Pin(&s[0])
	return uint64(uintptr(unsafe.Pointer(&s[0])))
}

// geometry is a launch configuration the kernel tests try: one block (so
// every grid-stride loop wraps), a few, and more than the work needs.
type geometry struct {
	grid, block uint32
}

var geometries = []geometry{{1, 32}, {3, 64}, {40, 128}}

// randF32 returns n values uniform in [-scale, scale).
func randF32(r *rand.Rand, n int, scale float64) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = float32((2*r.Float64() - 1) * scale)
	}
	return out
}

// garbage returns n NaNs, what an output holds before a kernel writes it,
// so that an element a kernel skips is seen.
func garbage(n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = float32(math.NaN())
	}
	return out
}

// garbage64 is garbage for float64 outputs.
func garbage64(n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = math.NaN()
	}
	return out
}

// checkClose reports the first element where |got − want| > rtol·|want| +
// atol, and NaNs that do not match.
func checkClose(t *testing.T, what string, got, want []float32, rtol, atol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d values, want %d", what, len(got), len(want))
		return
	}
	for i := range got {
		g, w := float64(got[i]), float64(want[i])
		if math.IsNaN(g) || math.IsNaN(w) {
			if math.IsNaN(g) != math.IsNaN(w) {
				t.Errorf("%s: [%d] = %v, want %v", what, i, g, w)
				return
			}
			continue
		}
		if math.Abs(g-w) > rtol*math.Abs(w)+atol {
			t.Errorf("%s: [%d] = %v, want %v (|diff| %.3g > %.3g·|want| + %.3g)", what, i, g, w, math.Abs(g-w), rtol, atol)
			return
		}
	}
}

// checkExact reports the first element whose bits differ.
func checkExact(t *testing.T, what string, got, want []float32) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Errorf("%s: [%d] = %v (%#x), want %v (%#x)", what, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
			return
		}
	}
}

func TestEmuKernels(t *testing.T) {
	e := buildEmu(t)
	for _, f := range KernelFiles() {
		for _, k := range f.Kernels {
			if e.has(k) != 1 {
				t.Errorf("%s's kernel %s is not registered with the emulator", f.Name, k)
			}
		}
	}
	t.Run("harness", func(t *testing.T) { testEmuHarness(t, e) })
	t.Run("elementwise", func(t *testing.T) { testElementwise(t, e) })
	t.Run("casts", func(t *testing.T) { testCasts(t, e) })
	t.Run("sums", func(t *testing.T) { testSums(t, e) })
	t.Run("layernorm", func(t *testing.T) { testLayerNorm(t, e) })
	t.Run("gelu", func(t *testing.T) { testBiasGELU(t, e) })
	t.Run("softmax", func(t *testing.T) { testSoftmax(t, e) })
	t.Run("softmax_dim", func(t *testing.T) { testSoftmaxDim(t, e) })
	t.Run("xent", func(t *testing.T) { testCrossEntropy(t, e) })
	t.Run("optim", func(t *testing.T) { testOptimizers(t, e) })
	t.Run("embedding", func(t *testing.T) { testEmbedding(t, e) })
	t.Run("shape", func(t *testing.T) { testShape(t, e) })
	t.Run("pointwise", func(t *testing.T) { testPointwise(t, e) })
	t.Run("flatten", func(t *testing.T) { testFlatten(t, e) })
	t.Run("vocab_ce", func(t *testing.T) { testVocabCE(t, e) })
	t.Run("router", func(t *testing.T) { testRouter(t, e) })
	t.Run("flash_attn", func(t *testing.T) { testFlashAttention(t, e) })
	t.Run("block_attn", func(t *testing.T) { testBlockAttention(t, e) })
}

// testEmuHarness checks the emulator itself: a block barrier (and a warp
// barrier, within the warp) makes every thread's write visible, shuffles return the source lane's value, and
// launches a GPU would not run as written fail naming the kernel.
func testEmuHarness(t *testing.T, e *emuLib) {
	const n, blocks = 96, 2
	order, down, xr, sw := make([]int32, blocks*n), make([]int32, blocks*n), make([]int32, blocks*n), make([]int32, blocks*n)
	if err := e.run("emu_barrier", d1(blocks), d1(n), 0, order, down, xr, sw); err != nil {
		t.Fatal(err)
	}
	for g := range int32(blocks * n) {
		i, k := g%n, 1000*(g/n)
		lane := i & 31
		wantDown := i
		if lane+5 < 32 {
			wantDown = i + 5
		}
		if order[g] != 3*((i+1)%n)+k || down[g] != wantDown || xr[g] != i^9 {
			t.Fatalf("thread %d: after the barrier read %d (want %d), shfl_down %d (want %d), shfl_xor %d (want %d)",
				g, order[g], 3*((i+1)%n)+k, down[g], wantDown, xr[g], i^9)
		}
		if want := 7*(i&^31+(i+1)&31) + k; sw[g] != want {
			t.Fatalf("thread %d: after __syncwarp read %d, want %d", g, sw[g], want)
		}
	}
	x := make([]int32, 64)
	for _, c := range []struct {
		kernel string
		block  uint32
		args   []any
		want   string
	}{
		{"emu_divergent", 64, []any{x}, "emu_divergent (block 0,0,0): a divergent barrier: 63 threads wait in __syncthreads, 1 have ended"},
		{"emu_shfl", 48, []any{x}, "emu_shfl (block 0,0,0): a warp operation in a warp of 16 threads"},
		{"emu_shfl", 64, []any{x, x}, "emu_shfl takes 1 arguments, not 2"},
		{"emu_none", 64, []any{x}, "no kernel emu_none"},
		{"emu_shfl", 2048, []any{x}, "emu_shfl: bad launch geometry"},
	} {
		err := e.run(c.kernel, d1(1), d1(c.block), 0, c.args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s with %d threads: %v, want an error with %q", c.kernel, c.block, err, c.want)
		}
	}
}

// Elementwise kernels evaluate the float32 expression package kernels
// evaluates, with no fused multiply-add: bit-exact.
func testElementwise(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 1, 7, 33, 1000, 4099} {
		for _, g := range geometries {
			name := fmt.Sprintf("n=%d/grid=%d×%d", n, g.grid, g.block)
			x, y := randF32(r, n, 3), randF32(r, n, 3)
			grid, block := d1(g.grid), d1(g.block)

			got, want := garbage(n), make([]float32, n)
			if err := e.run("loom_axpby_f32", grid, block, 0, got, x, y, float32(1), float32(1), int64(n)); err != nil {
				t.Fatal(err)
			}
			if err := kernels.Add(want, x, y); err != nil {
				t.Fatal(err)
			}
			checkExact(t, name+": axpby(1, 1) vs kernels.Add", got, want)

			a, b := float32(0.37), float32(-2.5)
			for i := range want {
				want[i] = a*x[i] + b*y[i]
			}
			alias := slices.Clone(y) // out aliases y
			if err := e.run("loom_axpby_f32", grid, block, 0, alias, x, alias, a, b, int64(n)); err != nil {
				t.Fatal(err)
			}
			checkExact(t, name+": axpby(0.37, -2.5), out = y", alias, want)

			for i := range want {
				want[i] = a * x[i]
			}
			got = garbage(n)
			if err := e.run("loom_axpby_f32", grid, block, 0, got, x, []float32(nil), a, float32(0), int64(n)); err != nil {
				t.Fatal(err)
			}
			checkExact(t, name+": axpby(0.37, 0), y null", got, want)

			got = garbage(n)
			if err := e.run("loom_mul_f32", grid, block, 0, got, x, y, int64(n)); err != nil {
				t.Fatal(err)
			}
			if err := kernels.Mul(want, x, y); err != nil {
				t.Fatal(err)
			}
			checkExact(t, name+": mul vs kernels.Mul", got, want)

			got = garbage(n)
			if err := e.run("loom_fill_f32", grid, block, 0, got, float32(-0.75), int64(n)); err != nil {
				t.Fatal(err)
			}
			for i := range want {
				want[i] = -0.75
			}
			checkExact(t, name+": fill", got, want)
		}
	}
}

// The casts are bit-exact against internal/half: every bfloat16 pattern
// widens, and float32 values of every class narrow (ties both ways,
// subnormals, overflow to infinity, NaNs with payloads).
func testCasts(t *testing.T, e *emuLib) {
	all := make([]uint16, 1<<16)
	for i := range all {
		all[i] = uint16(i)
	}
	wide := garbage(len(all))
	if err := e.run("loom_cast_bf16_f32", d1(7), d1(256), 0, wide, all, int64(len(all))); err != nil {
		t.Fatal(err)
	}
	for i, h := range all {
		if w := half.BFloat16ToFloat32(h); math.Float32bits(wide[i]) != math.Float32bits(w) {
			t.Fatalf("bf16 %#04x widened to %#x, want %#x", h, math.Float32bits(wide[i]), math.Float32bits(w))
		}
	}
	bits := []uint32{
		0, 0x80000000, 0x3f800000, 0x3f808000, 0x3f818000, 0x3f808001, 0x3f807fff, // ties to even both ways
		0x00000001, 0x00008000, 0x00018000, 0x807fffff, // subnormals
		0x7f7fffff, 0x7f7f8000, 0x7f7f7fff, 0xff7fffff, // the largest finite: to infinity or not
		0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xff800001, 0x7fbfffff, // infinities, NaNs
	}
	r := rand.New(rand.NewPCG(3, 4))
	for range 5000 {
		bits = append(bits, r.Uint32())
	}
	x := make([]float32, len(bits))
	for i, b := range bits {
		x[i] = math.Float32frombits(b)
	}
	for _, g := range geometries {
		got := make([]uint16, len(x))
		for i := range got {
			got[i] = 0xdead
		}
		if err := e.run("loom_cast_f32_bf16", d1(g.grid), d1(g.block), 0, got, x, int64(len(x))); err != nil {
			t.Fatal(err)
		}
		for i, v := range x {
			if w := half.ToBFloat16(v); got[i] != w {
				t.Fatalf("grid %d×%d: float32 %#x narrowed to bf16 %#04x, want %#04x", g.grid, g.block, bits[i], got[i], w)
			}
		}
	}
}

// Sums accumulate in double on both sides, in different orders, and round
// once to float32: they agree to about one float32 ulp of the sum of the
// magnitudes (1e-6 relative to it, with room for the order).
func testSums(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, s := range []struct{ outer, mid, inner int }{
		{1, 1, 1}, {1, 17, 7}, {3, 5, 33}, {2, 257, 1}, {4, 0, 3}, {1, 3, 128}, {2, 64, 257},
	} {
		x := randF32(r, s.outer*s.mid*s.inner, 2)
		want, mag := make([]float32, s.outer*s.inner), make([]float32, s.inner)
		for o := range s.outer {
			if err := kernels.ColumnSums(want[o*s.inner:(o+1)*s.inner], x[o*s.mid*s.inner:(o+1)*s.mid*s.inner], s.inner); err != nil {
				t.Fatal(err)
			}
		}
		for _, b := range []dims{{32, 8, 1}, {1, 64, 1}, {128, 1, 1}, {7, 3, 1}} {
			for _, grid := range []uint32{1, 5} {
				got := garbage(len(want))
				smem := 8 * b.x * b.y
				if err := e.run("loom_sum_mid_f32", d1(grid), b, smem, got, x, int64(s.outer), int64(s.mid), int64(s.inner)); err != nil {
					t.Fatal(err)
				}
				for o := range s.outer {
					for i := range s.inner {
						mag[i] = 0
						for m := range s.mid {
							mag[i] += float32(math.Abs(float64(x[(o*s.mid+m)*s.inner+i])))
						}
					}
					what := fmt.Sprintf("sum_mid %v, block %v, grid %d, outer %d vs kernels.ColumnSums", s, b, grid, o)
					checkSum(t, what, got[o*s.inner:(o+1)*s.inner], want[o*s.inner:(o+1)*s.inner], mag)
				}
			}
		}
	}

	// Σ x² in double, partial per block, then loom_sum_f64; the reference
	// is optim's localNorm for p = 2 (a float64 loop). Both sums are of
	// exact double squares in different orders: 1e-13 relative.
	for _, n := range []int{0, 1, 7, 33, 1000, 4099} {
		x := randF32(r, n, 2)
		want := 0.0
		for _, v := range x {
			want += float64(v) * float64(v)
		}
		for _, g := range []geometry{{1, 32}, {3, 64}, {9, 256}} {
			part := make([]float64, g.grid)
			for i := range part {
				part[i] = math.NaN()
			}
			if err := e.run("loom_sumsq_f32", d1(g.grid), d1(g.block), 0, part, x, int64(n)); err != nil {
				t.Fatal(err)
			}
			got := []float64{math.NaN()}
			if err := e.run("loom_sum_f64", d1(1), d1(64), 0, got, part, int64(len(part))); err != nil {
				t.Fatal(err)
			}
			if math.Abs(got[0]-want) > 1e-13*want {
				t.Errorf("sumsq n=%d grid %d×%d: %v, want %v", n, g.grid, g.block, got[0], want)
			}
		}
	}
}

// checkSum compares sums within 1e-6 of the sum of the magnitudes mag.
func checkSum(t *testing.T, what string, got, want, mag []float32) {
	t.Helper()
	checkSumTol(t, what, got, want, mag, 1e-6)
}

// checkSumTol compares sums within tol times the sum of the magnitudes mag.
func checkSumTol(t *testing.T, what string, got, want, mag []float32, tol float64) {
	t.Helper()
	for i := range want {
		if d := math.Abs(float64(got[i]) - float64(want[i])); !(d <= tol*float64(mag[i])) {
			t.Errorf("%s: [%d] = %v, want %v", what, i, got[i], want[i])
			return
		}
	}
}

// LayerNorm: the kernels accumulate the row statistics in double, like the
// CPU, in another order, and evaluate the affine map in double before one
// rounding; outputs of size about 1 agree within 1e-6 (a few float32 ulp),
// the saved mean and rstd (double, as the CPU keeps them) within 1e-12
// relative (the order of the double sums); the backward's dw and db go
// through float32 per-warp partials, so those get 1e-5 of the sum of the
// magnitudes.
func testLayerNorm(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(7, 8))
	const eps = 1e-5
	for _, rows := range []int{0, 1, 3, 17} {
		for _, n := range []int{1, 7, 33, 128, 257} {
			x := randF32(r, rows*n, 1)
			for i := range x {
				x[i] += 3 // a mean far from 0
			}
			w, b, dy := randF32(r, n, 1.5), randF32(r, n, 0.5), randF32(r, rows*n, 1)
			for _, affine := range []bool{true, false} {
				ww, bb := w, b
				if !affine {
					ww, bb = nil, nil
				}
				want, mean, rstd := make([]float32, rows*n), make([]float64, rows), make([]float64, rows)
				if err := kernels.LayerNorm(want, mean, rstd, x, ww, bb, n, eps); err != nil {
					t.Fatal(err)
				}
				// The backward takes the CPU's statistics on both sides.
				m64, r64 := mean, rstd
				wantDx, wantDw, wantDb := make([]float32, rows*n), make([]float32, n), make([]float32, n)
				if err := kernels.LayerNormBackward(wantDx, wantDw, wantDb, dy, x, ww, m64, r64, n); err != nil {
					t.Fatal(err)
				}
				magW, magB := make([]float32, n), make([]float32, n)
				for i := range rows {
					for j := range n {
						xh := (float64(x[i*n+j]) - m64[i]) * r64[i]
						magW[j] += float32(math.Abs(float64(dy[i*n+j]) * xh))
						magB[j] += float32(math.Abs(float64(dy[i*n+j])))
					}
				}
				for _, g := range []geometry{{1, 32}, {1, 64}, {3, 64}, {9, 128}} {
					what := fmt.Sprintf("rows %d, n %d, affine %v, grid %d×%d", rows, n, affine, g.grid, g.block)
					y, gm, gr := garbage(rows*n), garbage64(rows), garbage64(rows)
					if err := e.run("loom_layernorm_fwd_f32", d1(g.grid), d1(g.block), 0, y, gm, gr, x, ww, bb, int64(rows), int32(n), float64(eps)); err != nil {
						t.Fatal(err)
					}
					checkClose(t, what+": y vs kernels.LayerNorm", y, want, 1e-6, 1e-6)
					for i := range rows {
						if math.Abs(gm[i]-mean[i]) > 1e-12*math.Abs(mean[i]) || math.Abs(gr[i]-rstd[i]) > 1e-12*rstd[i] {
							t.Errorf("%s: row %d: mean %v, rstd %v; want %v, %v", what, i, gm[i], gr[i], mean[i], rstd[i])
						}
					}

					warps := int(g.grid * g.block / 32)
					dx, dwp, dbp := garbage(rows*n), garbage(warps*n), garbage(warps*n)
					if err := e.run("loom_layernorm_bwd_f32", d1(g.grid), d1(g.block), 0, dx, dwp, dbp, dy, x, ww, m64, r64, int64(rows), int32(n)); err != nil {
						t.Fatal(err)
					}
					checkClose(t, what+": dx vs kernels.LayerNormBackward", dx, wantDx, 1e-5, 1e-5)
					dw, db := garbage(n), garbage(n)
					for _, s := range []struct {
						out, part []float32
					}{{dw, dwp}, {db, dbp}} {
						if err := e.run("loom_sum_mid_f32", d1(2), dims{32, 4, 1}, 8*32*4, s.out, s.part, int64(1), int64(warps), int64(n)); err != nil {
							t.Fatal(err)
						}
					}
					checkSumTol(t, what+": dw", dw, wantDw, magW, 1e-5)
					checkSumTol(t, what+": db", db, wantDb, magB, 1e-5)
				}
			}
		}
	}
}

// Bias-GELU evaluates erfc and exp in float32 where the CPU uses float64:
// y within 4e-6 relative (erfc's argument carries a float32 rounding that
// its slope multiplies by up to 2z² in the tail, z ≤ 3.5 here), plus 1e-7
// absolute where y is tiny; GELU' crosses zero near −0.75 and takes 1e-6
// absolute there. The backward is loom_mul_f32 and loom_sum_mid_f32,
// checked against kernels.BiasGELUBackward: dx bit-exact, dbias 1e-6 of
// the magnitudes.
func testBiasGELU(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(9, 10))
	for _, rows := range []int{0, 1, 3, 17} {
		for _, n := range []int{1, 7, 33, 128, 257} {
			x, bias, dy := randF32(r, rows*n, 4), randF32(r, n, 1), randF32(r, rows*n, 1)
			for _, withBias := range []bool{true, false} {
				b := bias
				if !withBias {
					b = nil
				}
				want, wantD := make([]float32, rows*n), make([]float32, rows*n)
				if err := kernels.BiasGELU(1, want, wantD, x, b, n); err != nil {
					t.Fatal(err)
				}
				wantDx, wantDb := make([]float32, rows*n), make([]float32, n)
				if err := kernels.BiasGELUBackward(wantDx, wantDb, dy, wantD, n); err != nil {
					t.Fatal(err)
				}
				mag := make([]float32, n)
				for i := range wantDx {
					mag[i%n] += float32(math.Abs(float64(wantDx[i])))
				}
				for _, g := range geometries {
					what := fmt.Sprintf("rows %d, n %d, bias %v, grid %d×%d", rows, n, withBias, g.grid, g.block)
					y, d := garbage(rows*n), garbage(rows*n)
					if err := e.run("loom_bias_gelu_fwd_f32", d1(g.grid), d1(g.block), 0, y, d, x, b, int64(rows), int32(n)); err != nil {
						t.Fatal(err)
					}
					checkClose(t, what+": y vs kernels.BiasGELU", y, want, 4e-6, 1e-7)
					checkClose(t, what+": deriv vs kernels.BiasGELU", d, wantD, 4e-6, 1e-6)

					dx, db := garbage(rows*n), garbage(n)
					if err := e.run("loom_mul_f32", d1(g.grid), d1(g.block), 0, dx, dy, wantD, int64(rows*n)); err != nil {
						t.Fatal(err)
					}
					checkExact(t, what+": dx vs kernels.BiasGELUBackward", dx, wantDx)
					if err := e.run("loom_sum_mid_f32", d1(g.grid), dims{32, 4, 1}, 8*32*4, db, dx, int64(1), int64(rows), int64(n)); err != nil {
						t.Fatal(err)
					}
					checkSum(t, what+": dbias vs kernels.BiasGELUBackward", db, wantDb, mag)
				}
			}
		}
	}
}

// Softmax: float32 expf of an argument formed in double, where the CPU
// evaluates exp in double: probabilities within 2e-6 relative (expf's ulps
// and the float32 rounding of the argument, |x − lse| < 20 here) plus 1e-7
// absolute, log-probabilities within 1e-6 plus 1e-6 absolute. The backward
// kernels take the CPU's forward output and sum in double like it: 1e-6
// relative plus 1e-6 absolute (the log-softmax one calls expf).
func testSoftmax(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(11, 12))
	for _, rows := range []int{0, 1, 3, 17} {
		for _, n := range []int{1, 7, 33, 128, 257} {
			x, dy := randF32(r, rows*n, 4), randF32(r, rows*n, 1)
			for _, logOut := range []bool{false, true} {
				want, wantDx := make([]float32, rows*n), make([]float32, rows*n)
				ref, refBack, kernel, back := kernels.SoftmaxRows, "kernels.SoftmaxRowsBackward", "loom_softmax_rows_bwd_f32", "softmax"
				rtol, atol, flag := 2e-6, 1e-7, int32(0)
				if logOut {
					flag = 1
					ref, refBack, kernel, back = kernels.LogSoftmaxRows, "kernels.LogSoftmaxRowsBackward", "loom_logsoftmax_rows_bwd_f32", "log-softmax"
					rtol, atol = 1e-6, 1e-6
				}
				if err := ref(1, want, x, n); err != nil {
					t.Fatal(err)
				}
				var err error
				if logOut {
					err = kernels.LogSoftmaxRowsBackward(1, wantDx, want, dy, n)
				} else {
					err = kernels.SoftmaxRowsBackward(wantDx, want, dy, n)
				}
				if err != nil {
					t.Fatal(err)
				}
				for _, g := range []geometry{{1, 32}, {3, 64}, {9, 128}} {
					what := fmt.Sprintf("%s rows %d, n %d, grid %d×%d", back, rows, n, g.grid, g.block)
					y := slices.Clone(x) // in place: y aliases x
					if err := e.run("loom_softmax_rows_f32", d1(g.grid), d1(g.block), 0, y, y, int64(rows), int32(n), flag); err != nil {
						t.Fatal(err)
					}
					checkClose(t, what+": forward", y, want, rtol, atol)
					dx := garbage(rows * n)
					if err := e.run(kernel, d1(g.grid), d1(g.block), 0, dx, want, dy, int64(rows), int32(n)); err != nil {
						t.Fatal(err)
					}
					checkClose(t, what+": backward vs "+refBack, dx, wantDx, 1e-6, 1e-6)
				}
			}
		}
	}
	for _, blocks := range []int{1, 3} {
		for _, tt := range []int{1, 5, 64, 65} {
			for _, scale := range []float32{1, 0.125} {
				x, dy := randF32(r, blocks*tt*tt, 8), randF32(r, blocks*tt*tt, 1)
				want, wantDx := make([]float32, len(x)), make([]float32, len(x))
				if err := kernels.CausalSoftmax(1, want, x, tt, scale); err != nil {
					t.Fatal(err)
				}
				if err := kernels.CausalSoftmaxBackward(wantDx, want, dy, tt, scale); err != nil {
					t.Fatal(err)
				}
				for _, g := range []geometry{{1, 32}, {4, 64}} {
					what := fmt.Sprintf("causal blocks %d, t %d, scale %v, grid %d×%d", blocks, tt, scale, g.grid, g.block)
					y := garbage(len(x))
					if err := e.run("loom_causal_softmax_f32", d1(g.grid), d1(g.block), 0, y, x, int64(blocks), int32(tt), scale); err != nil {
						t.Fatal(err)
					}
					checkClose(t, what+": vs kernels.CausalSoftmax", y, want, 2e-6, 1e-7)
					dx := garbage(len(x))
					if err := e.run("loom_causal_softmax_bwd_f32", d1(g.grid), d1(g.block), 0, dx, want, dy, int64(blocks), int32(tt), scale); err != nil {
						t.Fatal(err)
					}
					checkClose(t, what+": vs kernels.CausalSoftmaxBackward", dx, wantDx, 1e-6, 1e-6)
				}
			}
		}
	}
}

// Cross-entropy: logsumexp in double from float32 expf terms (the CPU's
// are double): lse and the summed loss within 1e-6 relative; gradients,
// expf of an argument formed in double, within 2e-6 relative plus 1e-7
// absolute (scale 1/rows keeps them below 1).
func testCrossEntropy(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(13, 14))
	for _, rows := range []int{0, 1, 3, 17} {
		for _, v := range []int{1, 7, 300} {
			x := randF32(r, rows*v, 6)
			targets := make([]int64, rows)
			for i := range targets {
				targets[i] = int64(r.IntN(v))
			}
			wantLse := make([]float64, rows)
			total, err := kernels.CrossEntropyRows(1, wantLse, x, targets, v)
			if err != nil {
				t.Fatal(err)
			}
			scale := 1 / float64(max(rows, 1))
			wantDx := make([]float32, rows*v)
			if err := kernels.CrossEntropyRowsBackward(1, wantDx, x, targets, wantLse, v, scale); err != nil {
				t.Fatal(err)
			}
			for _, g := range []geometry{{1, 32}, {3, 64}, {9, 128}} {
				what := fmt.Sprintf("rows %d, v %d, grid %d×%d", rows, v, g.grid, g.block)
				loss, lse := make([]float64, rows), make([]float64, rows)
				if err := e.run("loom_xent_fwd_f32", d1(g.grid), d1(g.block), 0, loss, lse, x, targets, int64(rows), int32(v)); err != nil {
					t.Fatal(err)
				}
				for i := range rows {
					if math.Abs(lse[i]-wantLse[i]) > 1e-6*math.Abs(wantLse[i])+1e-7 {
						t.Errorf("%s: lse[%d] = %v, want %v", what, i, lse[i], wantLse[i])
					}
				}
				sum := []float64{math.NaN()}
				if err := e.run("loom_sum_f64", d1(1), d1(64), 0, sum, loss, int64(rows)); err != nil {
					t.Fatal(err)
				}
				if math.Abs(sum[0]-total) > 1e-6*math.Abs(total)+1e-7 {
					t.Errorf("%s: loss %v, want %v (kernels.CrossEntropyRows)", what, sum[0], total)
				}
				dx := slices.Clone(x) // in place: dx aliases logits
				if err := e.run("loom_xent_bwd_f32", d1(g.grid), d1(g.block), 0, dx, dx, targets, wantLse, int64(rows), int32(v), float32(scale)); err != nil {
					t.Fatal(err)
				}
				checkClose(t, what+": dx vs kernels.CrossEntropyRowsBackward", dx, wantDx, 2e-6, 1e-7)
			}
		}
	}
	// A target outside [0, v) gives a NaN loss, not a read outside the row.
	loss := []float64{0}
	if err := e.run("loom_xent_fwd_f32", d1(1), d1(32), 0, loss, []float64(nil), []float32{1, 2}, []int64{2}, int64(1), int32(2)); err != nil || !math.IsNaN(loss[0]) {
		t.Errorf("target 2 of 2 classes: loss %v, %v; want NaN", loss[0], err)
	}
	// loom_xent_targets keeps the least row whose target is outside
	// [0, v) (the CPU's first error), whichever thread sees it first; a
	// clean check leaves ~0 (−1 here), a smaller row already there stays.
	long := make([]int64, 1000)
	long[700], long[999] = 3, -5
	for _, c := range []struct {
		targets   []int64
		slot, bad int64
	}{
		{[]int64{0, 1, 2, 2, 0}, -1, -1},
		{[]int64{0, 3, 2, -1, 7}, -1, 1},
		{[]int64{-1}, -1, 0},
		{long, -1, 700},
		{long, 5, 5},
	} {
		for _, g := range geometries {
			slot := []int64{c.slot}
			if err := e.run("loom_xent_targets", d1(g.grid), d1(g.block), 0, slot, c.targets, int64(len(c.targets)), int64(3)); err != nil {
				t.Fatal(err)
			}
			if slot[0] != c.bad {
				t.Errorf("targets check of %d targets from %d, grid %d×%d: %d, want %d", len(c.targets), c.slot, g.grid, g.block, slot[0], c.bad)
			}
		}
	}
}

// The optimizer kernels round every intermediate to float32 in the CPU's
// order, with IEEE division and square root: bit-exact, over three steps
// so the moments and momentum buffers carry over.
func testOptimizers(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(15, 16))
	for _, n := range []int{0, 1, 7, 33, 1000} {
		for _, g := range geometries {
			what := fmt.Sprintf("n %d, grid %d×%d", n, g.grid, g.block)
			p := randF32(r, n, 1)
			m, v := make([]float32, n), make([]float32, n)
			dp, dm, dv := slices.Clone(p), slices.Clone(m), slices.Clone(v)
			const lr, wd, b1, b2, eps = 3e-4, 0.1, 0.9, 0.95, 1e-8
			for step := 1; step <= 3; step++ {
				grad := randF32(r, n, 1)
				c := [8]float32{1 - lr*wd, b1, 1 - b1, b2, 1 - b2, float32(math.Sqrt(1 - math.Pow(b2, float64(step)))),
					float32(-lr / (1 - math.Pow(b1, float64(step)))), eps}
				if err := kernels.AdamW(p, grad, m, v, &c); err != nil {
					t.Fatal(err)
				}
				if err := e.run("loom_adamw_f32", d1(g.grid), d1(g.block), 0, dp, grad, dm, dv, int64(n),
					c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]); err != nil {
					t.Fatal(err)
				}
				checkExact(t, fmt.Sprintf("%s, step %d: AdamW p vs kernels.AdamW", what, step), dp, p)
				checkExact(t, fmt.Sprintf("%s, step %d: AdamW m", what, step), dm, m)
				checkExact(t, fmt.Sprintf("%s, step %d: AdamW v", what, step), dv, v)
			}

			for _, c := range []struct {
				wd, mu, dampening  float32
				maximize, nesterov bool
			}{{0, 0, 0, false, false}, {0.01, 0.9, 0, false, false}, {0.01, 0.9, 0, true, true}, {0, 0.5, 0.25, false, false}} {
				p := randF32(r, n, 1)
				dp := slices.Clone(p)
				var buf, dbuf []float32
				if c.mu != 0 {
					buf, dbuf = make([]float32, n), garbage(n)
				}
				for step := 1; step <= 3; step++ {
					grad := randF32(r, n, 1)
					sgdReference(p, grad, buf, 0.05, c.wd, c.mu, 1-c.dampening, c.maximize, c.nesterov, step == 1)
					flags := int32(0)
					if c.maximize {
						flags |= 1
					}
					if c.nesterov {
						flags |= 2
					}
					if step == 1 {
						flags |= 4
					}
					if err := e.run("loom_sgd_f32", d1(g.grid), d1(g.block), 0, dp, grad, dbuf, int64(n),
						float32(0.05), c.wd, c.mu, 1-c.dampening, flags); err != nil {
						t.Fatal(err)
					}
					checkExact(t, fmt.Sprintf("%s, SGD %+v, step %d: p", what, c, step), dp, p)
					checkExact(t, fmt.Sprintf("%s, SGD %+v, step %d: buf", what, c, step), dbuf, buf)
				}
			}
		}
	}
}

// sgdReference is optim's float32 SGD update (optim/sgd.go sgdUpdate,
// unexported there), every intermediate rounded to float32.
func sgdReference(p, g, buf []float32, lr, wd, mu, damp float32, maximize, nesterov, first bool) {
	for i := range p {
		d := g[i]
		if maximize {
			d = -d
		}
		if wd != 0 {
			d = d + float32(wd*p[i])
		}
		if mu != 0 {
			if first {
				buf[i] = d
			} else {
				buf[i] = float32(mu*buf[i]) + float32(damp*d)
			}
			if nesterov {
				d = d + float32(mu*buf[i])
			} else {
				d = buf[i]
			}
		}
		p[i] = p[i] - float32(lr*d)
	}
}

// Embedding: the lookup copies rows (bit-exact); the gradient adds
// repeated ids' rows in float32 where autograd's embedBwd (the reference,
// unexported there) adds in float64: 1e-6 of the sum of the magnitudes.
// Tables are whole (lo 0) or a vocab-parallel rank's block (lo 3).
func testEmbedding(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(17, 18))
	for _, s := range []struct{ vocab, lo, vl, nids, d int }{
		{1, 0, 1, 1, 1}, {7, 0, 7, 17, 7}, {300, 3, 100, 33, 33}, {11, 3, 5, 40, 128},
	} {
		table := randF32(r, s.vl*s.d, 1)
		ids := make([]int64, s.nids)
		for i := range ids {
			ids[i] = int64(r.IntN(s.vocab))
		}
		g := randF32(r, s.nids*s.d, 1)
		want := make([]float32, s.nids*s.d)
		acc, mag := make([]float64, s.vl*s.d), make([]float32, s.vl*s.d)
		for i, id := range ids {
			row := int(id) - s.lo
			if row < 0 || row >= s.vl {
				continue
			}
			copy(want[i*s.d:(i+1)*s.d], table[row*s.d:(row+1)*s.d])
			for c := range s.d {
				acc[row*s.d+c] += float64(g[i*s.d+c])
				mag[row*s.d+c] += float32(math.Abs(float64(g[i*s.d+c])))
			}
		}
		wantD := make([]float32, len(acc))
		for i, v := range acc {
			wantD[i] = float32(v)
		}
		for _, geo := range geometries {
			what := fmt.Sprintf("%+v, grid %d×%d", s, geo.grid, geo.block)
			out := garbage(len(want))
			if err := e.run("loom_embedding_fwd_f32", d1(geo.grid), d1(geo.block), 0, out, table, ids, int64(s.nids), int64(s.lo), int64(s.vl), int64(s.d)); err != nil {
				t.Fatal(err)
			}
			checkExact(t, what+": lookup", out, want)
			dt := garbage(len(wantD))
			if err := e.run("loom_fill_f32", d1(geo.grid), d1(geo.block), 0, dt, float32(0), int64(len(dt))); err != nil {
				t.Fatal(err)
			}
			if err := e.run("loom_embedding_bwd_f32", d1(geo.grid), d1(geo.block), 0, dt, g, ids, int64(s.nids), int64(s.lo), int64(s.vl), int64(s.d)); err != nil {
				t.Fatal(err)
			}
			checkSum(t, what+": gradient", dt, wantD, mag)
		}
	}
}

// The softmax over a middle dim against kernels.Softmax64 and its
// backward: double on both sides, glibc's exp and log against Go's (the
// double may differ in its last bit): one float32 rounding apart, 2⁻²²
// relative plus 1e-7 absolute where a log-softmax near 0 cancels. With a
// NaN in a column the whole column is NaN on both sides.
func testSoftmaxDim(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(31, 32))
	for _, c := range [][3]int{{1, 1, 1}, {1, 5, 1}, {3, 7, 4}, {2, 33, 40}, {0, 3, 3}, {2, 0, 3}} {
		outer, n, inner := c[0], c[1], c[2]
		m := outer * n * inner
		x, y, dy := randF32(r, m, 6), randF32(r, m, 1), randF32(r, m, 1)
		if m > 1 {
			x[0] = float32(math.NaN())
		}
		for _, logOut := range []bool{false, true} {
			want, wantDx := make([]float32, m), make([]float32, m)
			if err := kernels.Softmax64(want, x, outer, n, inner, logOut); err != nil {
				t.Fatal(err)
			}
			if err := kernels.Softmax64Backward(wantDx, y, dy, outer, n, inner, logOut); err != nil {
				t.Fatal(err)
			}
			flag := int32(0)
			if logOut {
				flag = 1
			}
			for _, g := range geometries {
				what := fmt.Sprintf("%v log %v, grid %d×%d", c, logOut, g.grid, g.block)
				got := slices.Clone(x) // in place
				if err := e.run("loom_softmax_dim_f32", d1(g.grid), d1(g.block), 0, got, got, int64(outer), int64(n), int64(inner), flag); err != nil {
					t.Fatal(err)
				}
				checkClose(t, what+": vs kernels.Softmax64", got, want, 0x1p-22, 1e-7)
				dx := garbage(m)
				if err := e.run("loom_softmax_dim_bwd_f32", d1(g.grid), d1(g.block), 0, dx, y, dy, int64(outer), int64(n), int64(inner), flag); err != nil {
					t.Fatal(err)
				}
				checkClose(t, what+": vs kernels.Softmax64Backward", dx, wantDx, 0x1p-22, 1e-7)
			}
		}
	}
}
