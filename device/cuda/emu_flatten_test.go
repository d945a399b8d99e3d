//go:build linux && (amd64 || arm64)

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/internal/half"
)

// The flatten kernels copy (bit-exact, NaN payloads too, when the scale is
// 1), scale by one float32 product as DDP's bucket fill does (dst[k] =
// v·float32(factor): bit-exact), and round to bfloat16 or widen from it as
// FSDP's staging copies do through internal/half (bit-exact). Buffers of
// length 0, 1 and odd lengths sit in a flat buffer with gaps, which must
// keep their contents.
func testFlatten(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(23, 24))
	for _, lens := range [][]int{{1}, {0, 7, 33}, {300, 1, 0, 257, 65}} {
		bufs := make([][]float32, len(lens))
		offs := make([]int, len(lens))
		total := 0
		for i, n := range lens {
			bufs[i] = randF32(r, n, 3)
			if n > 2 {
				bufs[i][1] = math.Float32frombits(0x7f801234) // a signalling NaN with a payload
			}
			total += 3 // a gap before each buffer
			offs[i] = total
			total += n
		}
		var pin runtime.Pinner
		table := make([]int64, 3*len(bufs))
		for i, b := range bufs {
			if len(b) > 0 {
				pin.Pin(&b[0])
				table[3*i] = int64(uintptr(unsafe.Pointer(&b[0])))
			}
			table[3*i+1], table[3*i+2] = int64(offs[i]), int64(len(b))
		}
		for _, scale := range []float32{1, 0.125, -3.7} {
			wantF, wantH := garbage(total), make([]uint16, total)
			for i := range wantH {
				wantH[i] = 0xdead
			}
			for i, b := range bufs {
				for k, v := range b {
					if scale != 1 {
						v *= scale
					}
					wantF[offs[i]+k], wantH[offs[i]+k] = v, half.ToBFloat16(v)
				}
			}
			for _, g := range []dims{{1, 1, 1}, {3, 2, 1}, {40, 7, 1}} {
				for _, block := range []uint32{32, 128} {
					what := fmt.Sprintf("lens %v, scale %v, grid %v×%d", lens, scale, g, block)
					flat := garbage(total)
					if err := e.run("loom_flatten_f32", g, d1(block), 0, flat, table, int32(len(bufs)), int32(0), scale); err != nil {
						t.Fatal(err)
					}
					checkExact(t, what+": flatten to float32", flat, wantF)
					flatH := make([]uint16, total)
					for i := range flatH {
						flatH[i] = 0xdead
					}
					if err := e.run("loom_flatten_f32", g, d1(block), 0, flatH, table, int32(len(bufs)), int32(1), scale); err != nil {
						t.Fatal(err)
					}
					for i := range flatH {
						if flatH[i] != wantH[i] {
							t.Fatalf("%s: flatten to bfloat16: [%d] = %#04x, want %#04x", what, i, flatH[i], wantH[i])
						}
					}

					// Back: the buffers become scale·flat, from float32 and
					// from bfloat16.
					saved := make([][]float32, len(bufs))
					for i, b := range bufs {
						saved[i] = append([]float32(nil), b...)
						for k := range b {
							b[k] = float32(math.NaN())
						}
					}
					if err := e.run("loom_unflatten_f32", g, d1(block), 0, flat, table, int32(len(bufs)), int32(0), scale); err != nil {
						t.Fatal(err)
					}
					for i, b := range bufs {
						want := make([]float32, len(b))
						for k := range b {
							v := flat[offs[i]+k]
							if scale != 1 {
								v *= scale
							}
							want[k] = v
						}
						checkExact(t, fmt.Sprintf("%s: unflatten float32, buffer %d", what, i), b, want)
					}
					if err := e.run("loom_unflatten_f32", g, d1(block), 0, flatH, table, int32(len(bufs)), int32(1), scale); err != nil {
						t.Fatal(err)
					}
					for i, b := range bufs {
						want := make([]float32, len(b))
						for k := range b {
							v := half.BFloat16ToFloat32(flatH[offs[i]+k])
							if scale != 1 {
								v *= scale
							}
							want[k] = v
						}
						checkExact(t, fmt.Sprintf("%s: unflatten bfloat16, buffer %d", what, i), b, want)
						copy(b, saved[i])
					}
				}
			}
		}
		pin.Unpin()
	}
}
