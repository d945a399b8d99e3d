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
// emu and with -device cpu: the second line names the device, -json's
// "device" holds it, and the losses are the same bit for bit (the emulated
// devices run the host's CPU kernels on the same data; the host's fused
// payload passes give the all-to-all-v's results).
func TestRunDevice(t *testing.T) {
	dir := t.TempDir()
	var losses [2][]float64
	for i, dev := range []string{"cpu", "emu"} {
		js := filepath.Join(dir, dev+".json")
		var out bytes.Buffer
		args := []string{"-dp", "1", "-ep", "2", "-steps", "2", "-every", "1", "-threads", "1", "-json", js, "-device", dev}
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
		if res.Device != dev || len(res.Losses) != 2 {
			t.Errorf("-device %s: -json wrote device %q and %d losses", dev, res.Device, len(res.Losses))
		}
		losses[i] = res.Losses
	}
	for s := range losses[0] {
		if math.Float64bits(losses[1][s]) != math.Float64bits(losses[0][s]) {
			t.Errorf("step %d: loss %v on emu, %v on cpu", s+1, losses[1][s], losses[0][s])
		}
	}
}
