package tinygpt

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"maps"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/b7ea7098/loom/reference"
)

func TestFixtureEmbedded(t *testing.T) {
	fx := loadFixture(t)
	for _, name := range []string{FixtureJSONName, FixtureSafetensorsName, SpecName} {
		if b, err := fs.ReadFile(reference.FS(), name); err != nil || len(b) == 0 {
			t.Errorf("embedded %s: %d bytes, %v", name, len(b), err)
		}
	}
	if fx.Safetensors != FixtureSafetensorsName || fx.SpecFile != SpecName {
		t.Errorf("fixture names its files %q and %q, want %q and %q", fx.Safetensors, fx.SpecFile, FixtureSafetensorsName, SpecName)
	}
}

// TestFixtureDamaged: a fixture whose files are missing or changed is an
// error, never a silent difference.
func TestFixtureDamaged(t *testing.T) {
	good := make(fstest.MapFS)
	for _, name := range []string{FixtureJSONName, FixtureSafetensorsName, SpecName} {
		b, err := fs.ReadFile(reference.FS(), name)
		if err != nil {
			t.Fatal(err)
		}
		good[name] = &fstest.MapFile{Data: b}
	}
	without := func(name string) fstest.MapFS {
		m := maps.Clone(good)
		delete(m, name)
		return m
	}
	flipped := maps.Clone(good)
	st := slices.Clone(good[FixtureSafetensorsName].Data)
	st[len(st)-1] ^= 1
	flipped[FixtureSafetensorsName] = &fstest.MapFile{Data: st}
	for _, tc := range []struct {
		name string
		fsys fstest.MapFS
		load string // error from LoadFixtureFS
		use  string // error from Params
	}{
		{"whole", good, "", ""},
		{"no JSON", without(FixtureJSONName), "file does not exist", ""},
		{"no tensors", without(FixtureSafetensorsName), "", "file does not exist"},
		{"one bit flipped", flipped, "", "SHA-256"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx, err := LoadFixtureFS(tc.fsys)
			if tc.load != "" {
				if err == nil || !strings.Contains(err.Error(), tc.load) {
					t.Fatalf("LoadFixtureFS error %v, want %q", err, tc.load)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			_, err = fx.Params(PrefixInit)
			if tc.use == "" {
				if err != nil {
					t.Fatalf("Params: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.use) {
				t.Errorf("Params error %v, want %q", err, tc.use)
			}
		})
	}
}

// TestFixtureComplete checks that Fixture has a field for every key of
// tiny_gpt.json, at every level, and that every field's key is present.
func TestFixtureComplete(t *testing.T) {
	data, err := fs.ReadFile(reference.FS(), FixtureJSONName)
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
			if tag == "-" || !tc.typ.Field(i).IsExported() {
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
	// The numbers of reference/TINY_GPT.md §6 and §7, as the JSON holds them.
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
	if _, err := fx.Spec(); err != nil {
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
	data, err := fs.ReadFile(reference.FS(), FixtureJSONName)
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
	if _, err := LoadFixtureFS(fstest.MapFS{}); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("LoadFixtureFS(empty) error %v", err)
	}
	parsed, err := ParseFixture(data)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := parsed.Tensors(); err == nil {
		t.Error("a parsed fixture without files opened its tensors")
	}
}
