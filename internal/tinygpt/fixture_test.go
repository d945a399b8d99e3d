package tinygpt

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

func TestFixtureDirFindsShared(t *testing.T) {
	dir, err := FixtureDir()
	if errors.Is(err, ErrNoFixture) {
		t.Skipf("the reference fixture is absent (../shared/reference beside the repository): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{FixtureJSONName, FixtureSafetensorsName, SpecName} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Error(err)
		}
	}
	if os.Getenv(ReferenceDirEnv) == "" {
		// From this package folder the fixture is ../../../shared/reference.
		want, _ := filepath.Abs("../../../shared/reference")
		if got, _ := filepath.Abs(dir); got != want {
			t.Errorf("FixtureDir() = %s, want %s", got, want)
		}
	}
}

func TestFixtureDirEnv(t *testing.T) {
	tmp := t.TempDir()
	for _, tc := range []struct {
		name, dir string
		absent    bool
	}{
		{"existing folder", tmp, false},
		{"absent folder", filepath.Join(tmp, "nope"), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(ReferenceDirEnv, tc.dir)
			dir, err := FixtureDir()
			if tc.absent {
				if !errors.Is(err, ErrNoFixture) || !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), tc.dir) {
					t.Errorf("FixtureDir() error %v, want ErrNoFixture naming %s", err, tc.dir)
				}
				if _, err := LoadDefaultFixture(); !errors.Is(err, ErrNoFixture) {
					t.Errorf("LoadDefaultFixture() error %v, want ErrNoFixture", err)
				}
				return
			}
			if err != nil || dir != tc.dir {
				t.Errorf("FixtureDir() = %q, %v; want %q", dir, err, tc.dir)
			}
		})
	}
}

func TestModuleRoot(t *testing.T) {
	root, ok := moduleRoot(".")
	if !ok {
		t.Fatal("no module root above the package folder")
	}
	want, _ := filepath.Abs("../..")
	if abs, _ := filepath.Abs(root); abs != want {
		t.Errorf("module root %s, want %s", abs, want)
	}
	for _, tc := range []struct {
		gomod string
		want  bool
	}{
		{"module github.com/b7ea7098/loom\n\ngo 1.26.0\n", true},
		{"// comment\nmodule \"github.com/b7ea7098/loom\"\n", true},
		{"module github.com/b7ea7098/loomx\n", false},
		{"go 1.26\n", false},
	} {
		if got := declaresModule([]byte(tc.gomod)); got != tc.want {
			t.Errorf("declaresModule(%q) = %v", tc.gomod, got)
		}
	}
}

// TestFixtureComplete checks that Fixture has a field for every key of
// tiny_gpt.json, at every level, and that every field's key is present.
func TestFixtureComplete(t *testing.T) {
	fx := loadFixture(t)
	data, err := os.ReadFile(filepath.Join(fx.Dir, FixtureJSONName))
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var strict Fixture
	if err := dec.Decode(&strict); err != nil {
		t.Fatalf("tiny_gpt.json has a key Fixture lacks: %v", err)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		typ  reflect.Type
		raw  json.RawMessage
	}{
		{"top level", reflect.TypeFor[Fixture](), data},
		{"config", reflect.TypeFor[FixtureConfig](), raw["config"]},
		{"tolerances", reflect.TypeFor[Tolerances](), raw["tolerances"]},
	} {
		var keys map[string]json.RawMessage
		if err := json.Unmarshal(tc.raw, &keys); err != nil {
			t.Fatal(err)
		}
		for i := range tc.typ.NumField() {
			tag := strings.Split(tc.typ.Field(i).Tag.Get("json"), ",")[0]
			if tag == "-" {
				continue
			}
			if _, ok := keys[tag]; !ok {
				t.Errorf("%s: field %s has key %q, which tiny_gpt.json lacks", tc.name, tc.typ.Field(i).Name, tag)
			}
		}
	}
}

func TestFixtureValues(t *testing.T) {
	fx := loadFixture(t)
	// The numbers of TINY_GPT.md §6 and §7, as the JSON holds them.
	for _, tc := range []struct {
		name      string
		got, want float64
		tol       float64
	}{
		{"loss_step1", fx.LossStep1, 5.520738124847412, 0},
		{"loss_step1_f64", fx.LossStep1F64, 5.520738432358634, 0},
		{"loss_step2", fx.LossStep2, 4.903787136077881, 0},
		{"grad_norm_step1", fx.GradNormStep1, 5.390138473222979, 0},
		{"uniform_loss_ln256", fx.UniformLossLn256, math.Log(256), 1e-15},
		{"grad_norms_step1[wte]", fx.GradNormsStep1["wte"], 1.446255, 5e-7},
		{"grad_norms_step1[h.0.attn.proj.bias]", fx.GradNormsStep1["h.0.attn.proj.bias"], 2.295330, 5e-7},
		{"grad_norms_step1[lm_head.weight]", fx.GradNormsStep1["lm_head.weight"], 1.676126, 5e-7},
		{"tolerances.loss_step1_rel", fx.Tolerances.LossStep1Rel, 1e-6, 0},
		{"tolerances.loss_step2_rel", fx.Tolerances.LossStep2Rel, 1e-5, 0},
		{"tolerances.grad_rel_l2_per_param", fx.Tolerances.GradRelL2PerParam, 1e-4, 0},
		{"tolerances.after1_max_abs_given_fixture_grads", fx.Tolerances.After1MaxAbsGivenFixtureGrads, 1e-6, 0},
		{"tolerances.after1_max_abs_end_to_end", fx.Tolerances.After1MaxAbsEndToEnd, 1e-4, 0},
		{"tolerances.loss_curve_abs_steps_le_100", fx.Tolerances.LossCurveAbsStepsLE100, 5e-3, 0},
		{"tolerances.loss_curve_abs_steps_gt_100", fx.Tolerances.LossCurveAbsStepsGT100, 0.1, 0},
		{"tolerances.loss_curve_abs_last_step", fx.Tolerances.LossCurveAbsLastStep, 0.05, 0},
	} {
		if math.Abs(tc.got-tc.want) > tc.tol {
			t.Errorf("%s = %v, want %v", tc.name, tc.got, tc.want)
		}
	}
	// The global norm is the L2 norm of the per-parameter norms.
	var sq float64
	for _, n := range fx.GradNormsStep1 {
		sq += n * n
	}
	if math.Abs(math.Sqrt(sq)-fx.GradNormStep1) > 1e-6 {
		t.Errorf("sqrt(Σ grad_norms_step1²) = %v, grad_norm_step1 = %v", math.Sqrt(sq), fx.GradNormStep1)
	}
	curve := []float64{2.853689, 2.657466, 2.484743, 2.345830, 2.224208, 2.157038, 2.097817, 2.068482, 1.965711, 1.857107}
	steps := []int{20, 40, 60, 80, 100, 120, 140, 160, 180, 200}
	if !slices.Equal(fx.LossCurveEvery20Steps, steps) || len(fx.LossCurveEvery20) != len(curve) {
		t.Fatalf("loss curve steps %v (%d values)", fx.LossCurveEvery20Steps, len(fx.LossCurveEvery20))
	}
	for i, s := range steps {
		if got, ok := fx.LossAt(s); !ok || math.Abs(got-curve[i]) > 5e-7 {
			t.Errorf("LossAt(%d) = %v, %v; §6 says %v", s, got, ok, curve[i])
		}
	}
	for _, tc := range []struct {
		step int
		want float64
		ok   bool
	}{{1, fx.LossStep1, true}, {2, fx.LossStep2, true}, {3, 0, false}, {0, 0, false}} {
		if got, ok := fx.LossAt(tc.step); got != tc.want || ok != tc.ok {
			t.Errorf("LossAt(%d) = %v, %v", tc.step, got, ok)
		}
	}
	if fx.Offsets(3) != nil || len(fx.Offsets(1)) != 16 {
		t.Error("Offsets returns the wrong batches")
	}
}

func TestTolerancesLossCurve(t *testing.T) {
	tol := Tolerances{LossCurveAbsStepsLE100: 5e-3, LossCurveAbsStepsGT100: 0.1, LossCurveAbsLastStep: 0.05}
	for _, tc := range []struct {
		step int
		want float64
	}{{1, 5e-3}, {20, 5e-3}, {100, 5e-3}, {101, 0.1}, {120, 0.1}, {180, 0.1}, {199, 0.1}, {200, 0.05}} {
		if got := tol.LossCurve(tc.step, 200); got != tc.want {
			t.Errorf("LossCurve(%d, 200) = %v, want %v", tc.step, got, tc.want)
		}
	}
}

func TestFixtureSafetensorsFile(t *testing.T) {
	fx := loadFixture(t)
	if err := fx.VerifySafetensors(); err != nil {
		t.Fatal(err)
	}
	if got := filepath.Base(fx.SafetensorsPath()); got != FixtureSafetensorsName {
		t.Errorf("SafetensorsPath() = %s", fx.SafetensorsPath())
	}
	if _, err := os.Stat(fx.SpecPath()); err != nil {
		t.Error(err)
	}
	broken := *fx
	broken.SafetensorsBytes++
	if err := broken.VerifySafetensors(); err == nil || !strings.Contains(err.Error(), "bytes") {
		t.Errorf("size mismatch not reported: %v", err)
	}
	broken = *fx
	broken.SafetensorsSHA256 = strings.Repeat("0", 64)
	if err := broken.VerifySafetensors(); err == nil || !strings.Contains(err.Error(), "SHA-256") {
		t.Errorf("hash mismatch not reported: %v", err)
	}
}

func TestFixtureCheck(t *testing.T) {
	fx := loadFixture(t)
	data, err := os.ReadFile(filepath.Join(fx.Dir, FixtureJSONName))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		modify func(m map[string]any)
		want   string
	}{
		{"unchanged", func(map[string]any) {}, ""},
		{"extra key ignored", func(m map[string]any) { m["new_key"] = 1 }, ""},
		{"missing tolerance", func(m map[string]any) { delete(m["tolerances"].(map[string]any), "loss_step2_rel") }, "tolerances.loss_step2_rel"},
		{"bad head_dim", func(m map[string]any) { m["config"].(map[string]any)["head_dim"] = 31.0 }, "head_dim=31"},
		{"bad config", func(m map[string]any) { m["config"].(map[string]any)["H"] = 3.0 }, "not divisible by H=3"},
		{"short offsets", func(m map[string]any) { m["batch2_offsets"] = []any{1.0} }, "batch2_offsets has 1 offsets"},
		{"swapped order", func(m map[string]any) {
			o := m["param_order"].([]any)
			o[0], o[1] = o[1], o[0]
		}, `param_order[0]="wpe"`},
		{"wrong n_params", func(m map[string]any) { m["n_params"] = 5.0 }, "n_params=5"},
		{"missing init norm", func(m map[string]any) { delete(m["init_norms"].(map[string]any), "wpe") }, `init_norms lacks "wpe"`},
		{"not JSON", nil, "fixture JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := []byte("{")
			if tc.modify != nil {
				var m map[string]any
				if err := json.Unmarshal(data, &m); err != nil {
					t.Fatal(err)
				}
				tc.modify(m)
				if in, err = json.Marshal(m); err != nil {
					t.Fatal(err)
				}
			}
			_, err := ParseFixture(in)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("ParseFixture: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("ParseFixture error %v, want %q", err, tc.want)
			}
		})
	}
	if _, err := LoadFixture(filepath.Join(t.TempDir(), "missing.json")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("LoadFixture(missing) error %v", err)
	}
}
