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

// TestRunDevice trains two steps on dp=2 × tp=2 with -device emu and with
// -device cpu, in float32 and with -mp bf16 (autocast, without -fsdp),
// and -mp bf16 with -fsdp 2 (FSDP's bf16 gathers and autocast): the
// second line names the device, -json's "device", "device_name", "gemm"
// and "peak_tflops" describe it (emu's GEMM line says it is emulated),
// the losses are the same bit for bit on both devices (the emulated
// devices run the host's CPU kernels on the same data, bf16 rounding
// included) and bf16's differ from float32's.
func TestRunDevice(t *testing.T) {
	dir := t.TempDir()
	losses := map[string][]float64{}
	for _, c := range []struct {
		dev, mp string
		extra   []string
		name    string // -json's device_name
		lines   []string
	}{
		{"cpu", "", nil, "host", []string{"dp=2 × tp=2, sp=false"}},
		{"emu", "", nil, "emu:0", []string{"GEMM: emulated on ", "(f32; emu:0's GEMMs run on the CPUs)"}},
		{"cpu", "bf16", nil, "host", []string{"sp=false, -mp bf16 (autocast)", "GEMM: ", "(bf16)"}},
		{"emu", "bf16", nil, "emu:0", []string{"-mp bf16 (autocast)", "(bf16; emu:0's GEMMs run on the CPUs)"}},
		{"emu", "bf16", []string{"-fsdp", "2", "-dp", "1"}, "emu:0", []string{"(ZeRO-3, reshard true, bf16 gathers), sp=false, -mp bf16 (autocast)"}},
	} {
		key := c.dev + "/" + c.mp + strings.Join(c.extra, "")
		js := filepath.Join(dir, strings.ReplaceAll(key, "/", "-")+".json")
		var out bytes.Buffer
		args := append([]string{"-dp", "2", "-tp", "2", "-steps", "2", "-every", "1", "-threads", "1", "-json", js, "-device", c.dev, "-mp", c.mp}, c.extra...)
		if err := run(context.Background(), args, &out); err != nil {
			t.Fatalf("run %v: %v\n%s", args, err, out.String())
		}
		if lines := strings.SplitN(out.String(), "\n", 3); len(lines) < 2 || !strings.HasPrefix(lines[1], "device: "+c.dev) {
			t.Errorf("%s: the second line is not the device's:\n%s", key, out.String())
		}
		for _, want := range c.lines {
			if !strings.Contains(out.String(), want) {
				t.Errorf("%s: the output lacks %q:\n%s", key, want, out.String())
			}
		}
		var res result
		b, err := os.ReadFile(js)
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, &res); err != nil {
			t.Fatal(err)
		}
		prec := "(f32"
		if c.mp != "" {
			prec = "(bf16"
		}
		if res.Device != c.dev || res.DeviceName != c.name || !strings.Contains(res.GEMM, prec) || !(res.PeakTFLOPS > 0) || len(res.Losses) != 2 {
			t.Errorf("%s: -json wrote device %q, device_name %q, gemm %q, peak_tflops %v and %d losses; want %s, %s, a GEMM in %s), a peak and 2",
				key, res.Device, res.DeviceName, res.GEMM, res.PeakTFLOPS, len(res.Losses), c.dev, c.name, prec)
		}
		losses[key] = res.Losses
	}
	for _, pair := range [][2]string{{"cpu/", "emu/"}, {"cpu/bf16", "emu/bf16"}} {
		for s := range losses[pair[0]] {
			if math.Float64bits(losses[pair[1]][s]) != math.Float64bits(losses[pair[0]][s]) {
				t.Errorf("step %d: loss %v on %s, %v on %s", s+1, losses[pair[1]][s], pair[1], losses[pair[0]][s], pair[0])
			}
		}
	}
	if d := math.Abs(losses["cpu/bf16"][1] - losses["cpu/"][1]); d == 0 || d > 1e-3 {
		t.Errorf("step 2: -mp bf16's loss is %.3g from float32's; want a difference, at most 1e-3 (TestAutocastLosses says why)", d)
	}
}
