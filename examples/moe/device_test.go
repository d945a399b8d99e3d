package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRunDevice trains the tiny MoE model two steps on ep=2 with -device
// emu and with -device cpu, in float32 and with -mp bf16 (autocast): the
// second line names the device, -json's "device", "gemm" and
// "peak_tflops" describe it, and the losses are the same bit for bit on
// both devices (the emulated devices run the host's CPU kernels on the
// same data; the host's fused payload passes give the all-to-all-v's
// results) and differ between float32 and bf16.
func TestRunDevice(t *testing.T) {
	dir := t.TempDir()
	var losses [4][]float64
	for i, dev := range []string{"cpu", "emu", "cpu", "emu"} {
		mp, prec := "", "(f32"
		if i >= 2 {
			mp, prec = "bf16", "(bf16"
		}
		js := filepath.Join(dir, dev+mp+".json")
		var out bytes.Buffer
		args := []string{"-dp", "1", "-ep", "2", "-steps", "2", "-every", "1", "-threads", "1", "-json", js, "-device", dev, "-mp", mp}
		if err := run(context.Background(), args, &out); err != nil {
			t.Fatalf("run %v: %v\n%s", args, err, out.String())
		}
		if lines := strings.SplitN(out.String(), "\n", 3); len(lines) < 2 || !strings.HasPrefix(lines[1], "device: "+dev) {
			t.Errorf("-device %s: the second line is not the device's:\n%s", dev, out.String())
		}
		var res result
		b, err := os.ReadFile(js)
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, &res); err != nil {
			t.Fatal(err)
		}
		if res.Device != dev || len(res.Losses) != 2 || !strings.Contains(res.GEMM, prec) || !(res.PeakTFLOPS > 0) {
			t.Errorf("-device %s -mp %q: -json wrote device %q, gemm %q, peak_tflops %v and %d losses", dev, mp, res.Device, res.GEMM, res.PeakTFLOPS, len(res.Losses))
		}
		losses[i] = res.Losses
	}
	for _, p := range [][2]int{{0, 1}, {2, 3}} {
		for s := range losses[p[0]] {
			if math.Float64bits(losses[p[1]][s]) != math.Float64bits(losses[p[0]][s]) {
				t.Errorf("step %d: loss %v on emu, %v on cpu (-mp bf16: %v)", s+1, losses[p[1]][s], losses[p[0]][s], p[0] == 2)
			}
		}
	}
	if losses[2][1] == losses[0][1] {
		t.Errorf("step 2: -mp bf16's loss equals float32's (%v)", losses[0][1])
	}
}
