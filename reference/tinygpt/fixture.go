package tinygpt

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"slices"

	"github.com/b7ea7098/loom/reference"
	"github.com/b7ea7098/loom/safetensors"
)

// File names of the fixture, in the reference package's files.
const (
	FixtureJSONName        = reference.TinyGPTJSON
	FixtureSafetensorsName = reference.TinyGPTSafetensors
	SpecName               = reference.TinyGPTSpec
)

// Fixture is tiny_gpt.json (reference/TINY_GPT.md §5.2), one field per key.
type Fixture struct {
	// fsys holds the fixture's files (not in the JSON).
	fsys fs.FS

	Fixture           string `json:"fixture"`            // "tiny_gpt"
	SpecFile          string `json:"spec"`               // "TINY_GPT.md"
	Safetensors       string `json:"safetensors"`        // file name of the tensors, beside the JSON
	SafetensorsSHA256 string `json:"safetensors_sha256"` // hex SHA-256 of that file
	SafetensorsBytes  int64  `json:"safetensors_bytes"`  // its size
	Torch             string `json:"torch"`              // PyTorch version of the reference

	Config FixtureConfig `json:"config"` // the §1 values

	NParams     int              `json:"n_params"`     // number of scalar parameters
	ParamOrder  []string         `json:"param_order"`  // parameter names in order
	ParamShapes map[string][]int `json:"param_shapes"` // shape of each parameter

	CorpusLen    int    `json:"corpus_len"`    // corpus length in bytes
	CorpusSHA256 string `json:"corpus_sha256"` // hex SHA-256 of the corpus
	CorpusHead   string `json:"corpus_head"`   // the first 160 corpus characters

	Batch1Offsets []int `json:"batch1_offsets"` // offsets of batch 1 (draws 0 … B−1)
	Batch2Offsets []int `json:"batch2_offsets"` // offsets of batch 2 (draws B … 2B−1)

	LossStep1         float64            `json:"loss_step1"`           // batch-1 loss at init.*, float32 computation
	LossStep1F64      float64            `json:"loss_step1_f64"`       // the same in float64
	LossStep2         float64            `json:"loss_step2"`           // batch-2 loss after one AdamW update
	GradNormStep1     float64            `json:"grad_norm_step1"`      // global L2 norm of the step-1 gradients
	GradNormsStep1    map[string]float64 `json:"grad_norms_step1"`     // per-parameter L2 norms of grad1.*
	GradNormsStep1F64 map[string]float64 `json:"grad_norms_step1_f64"` // the same, float64 computation
	InitNorms         map[string]float64 `json:"init_norms"`           // per-parameter L2 norms of init.*
	UniformLossLn256  float64            `json:"uniform_loss_ln256"`   // ln 256, the loss of a uniform prediction

	LossCurveEvery20      []float64 `json:"loss_curve_every_20"`       // training loss at LossCurveEvery20Steps
	LossCurveEvery20Steps []int     `json:"loss_curve_every_20_steps"` // 20, 40, …, 200
	LossCurveRun          string    `json:"loss_curve_run"`            // how the curve was produced

	Tolerances Tolerances `json:"tolerances"` // the §7 thresholds
}

// FixtureConfig is the "config" object of tiny_gpt.json.
type FixtureConfig struct {
	V           int        `json:"V"`
	D           int        `json:"D"`
	H           int        `json:"H"`
	HeadDim     int        `json:"head_dim"`
	L           int        `json:"L"`
	F           int        `json:"F"`
	T           int        `json:"T"`
	Batch       int        `json:"batch"`
	Steps       int        `json:"steps"`
	LR          float64    `json:"lr"`
	WeightDecay float64    `json:"weight_decay"`
	Betas       [2]float64 `json:"betas"`
	Eps         float64    `json:"eps"`
	CorpusSeed  uint32     `json:"corpus_seed"`
	BatchSeed   uint32     `json:"batch_seed"`
	CorpusLen   int        `json:"corpus_len"`
	InitSeed    int64      `json:"init_seed"` // PyTorch generator seed; not part of the spec
	InitStd     float64    `json:"init_std"`
	LNEps       float64    `json:"ln_eps"`
}

// Config converts the fixture's configuration into a Config and checks it,
// including that head_dim = D/H.
func (fc FixtureConfig) Config() (Config, error) {
	c := Config{
		V: fc.V, D: fc.D, H: fc.H, L: fc.L, F: fc.F, T: fc.T, B: fc.Batch,
		CorpusLen: fc.CorpusLen, CorpusSeed: fc.CorpusSeed, BatchSeed: fc.BatchSeed,
		LR: fc.LR, WD: fc.WeightDecay, Beta1: fc.Betas[0], Beta2: fc.Betas[1], Eps: fc.Eps,
		Steps: fc.Steps, InitStd: fc.InitStd, LNEps: fc.LNEps,
	}
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	if fc.HeadDim != c.HeadDim() {
		return Config{}, fmt.Errorf("tinygpt: fixture config: head_dim=%d but D/H=%d", fc.HeadDim, c.HeadDim())
	}
	return c, nil
}

// Tolerances are the parity thresholds of reference/TINY_GPT.md §7.
type Tolerances struct {
	LossStep1Rel                  float64 `json:"loss_step1_rel"`                     // test 2: |loss−loss_step1| ≤ this·loss_step1
	LossStep2Rel                  float64 `json:"loss_step2_rel"`                     // test 5: step-2 loss, relative
	GradRelL2PerParam             float64 `json:"grad_rel_l2_per_param"`              // test 3: ‖g−grad1‖₂/‖grad1‖₂ per parameter
	After1MaxAbsGivenFixtureGrads float64 `json:"after1_max_abs_given_fixture_grads"` // test 4: AdamW on grad1.*, max |p−after1|
	After1MaxAbsEndToEnd          float64 `json:"after1_max_abs_end_to_end"`          // test 5: AdamW on own gradients, max |p−after1|
	LossCurveAbsStepsLE100        float64 `json:"loss_curve_abs_steps_le_100"`        // test 6: |Δloss| at steps ≤ 100
	LossCurveAbsStepsGT100        float64 `json:"loss_curve_abs_steps_gt_100"`        // test 6: |Δloss| at steps > 100 except the last
	LossCurveAbsLastStep          float64 `json:"loss_curve_abs_last_step"`           // test 6: |Δloss| at the last step
}

// LossCurve returns the absolute loss tolerance of test 6 at step, for a run
// of lastStep steps: LossCurveAbsLastStep at lastStep, LossCurveAbsStepsLE100
// at steps ≤ 100 and LossCurveAbsStepsGT100 otherwise.
func (t Tolerances) LossCurve(step, lastStep int) float64 {
	switch {
	case step == lastStep:
		return t.LossCurveAbsLastStep
	case step <= 100:
		return t.LossCurveAbsStepsLE100
	}
	return t.LossCurveAbsStepsGT100
}

// LoadFixture reads and checks the reference's tiny_gpt.json, embedded in
// package reference. Unknown keys are ignored; missing or inconsistent ones
// are errors (see Fixture.Check).
func LoadFixture() (*Fixture, error) { return LoadFixtureFS(reference.FS()) }

// LoadFixtureFS reads and checks tiny_gpt.json at the top of fsys, whose
// other files (the tensors, the specification) the Fixture then reads.
func LoadFixtureFS(fsys fs.FS) (*Fixture, error) {
	data, err := fs.ReadFile(fsys, FixtureJSONName)
	if err != nil {
		return nil, fmt.Errorf("tinygpt: %w", err)
	}
	fx, err := ParseFixture(data)
	if err != nil {
		return nil, fmt.Errorf("%w (in %s)", err, FixtureJSONName)
	}
	fx.fsys = fsys
	return fx, nil
}

// ParseFixture decodes tiny_gpt.json from data and checks it. The result
// has no files: its Tensors, Spec and VerifySafetensors fail.
func ParseFixture(data []byte) (*Fixture, error) {
	var fx Fixture
	if err := json.Unmarshal(data, &fx); err != nil {
		return nil, fmt.Errorf("tinygpt: fixture JSON: %w", err)
	}
	if err := fx.Check(); err != nil {
		return nil, err
	}
	return &fx, nil
}

// Check verifies that the fixture is complete and consistent with itself:
// a valid config, param_order/param_shapes/n_params/per-parameter norms agree
// with Config().Params(), two batches of B offsets, a loss curve with one
// value per step, and positive tolerances.
func (fx *Fixture) Check() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("tinygpt: fixture: "+format, args...))
	}
	cfg, err := fx.Config.Config()
	if err != nil {
		return fmt.Errorf("tinygpt: fixture: %w", err)
	}
	if fx.CorpusLen != cfg.CorpusLen {
		bad("corpus_len=%d but config.corpus_len=%d", fx.CorpusLen, cfg.CorpusLen)
	}
	if len(fx.CorpusSHA256) != 64 {
		bad("corpus_sha256 %q is not a hex SHA-256", fx.CorpusSHA256)
	}
	if len(fx.SafetensorsSHA256) != 64 {
		bad("safetensors_sha256 %q is not a hex SHA-256", fx.SafetensorsSHA256)
	}
	if fx.Safetensors == "" || fx.CorpusHead == "" {
		bad("safetensors or corpus_head is missing")
	}
	params := cfg.Params()
	if len(fx.ParamOrder) != len(params) {
		bad("param_order has %d names, config implies %d", len(fx.ParamOrder), len(params))
	} else {
		for i, p := range params {
			if fx.ParamOrder[i] != p.Name {
				bad("param_order[%d]=%q, want %q", i, fx.ParamOrder[i], p.Name)
			}
		}
	}
	for _, p := range params {
		if s, ok := fx.ParamShapes[p.Name]; !ok || !slices.Equal(s, p.Shape) {
			bad("param_shapes[%q]=%v, want %v", p.Name, s, p.Shape)
		}
		for key, m := range map[string]map[string]float64{
			"grad_norms_step1": fx.GradNormsStep1, "grad_norms_step1_f64": fx.GradNormsStep1F64, "init_norms": fx.InitNorms,
		} {
			if _, ok := m[p.Name]; !ok {
				bad("%s lacks %q", key, p.Name)
			}
		}
	}
	if len(fx.ParamShapes) != len(params) {
		bad("param_shapes has %d entries, want %d", len(fx.ParamShapes), len(params))
	}
	if fx.NParams != cfg.NumParams() {
		bad("n_params=%d, config implies %d", fx.NParams, cfg.NumParams())
	}
	for name, offs := range map[string][]int{"batch1_offsets": fx.Batch1Offsets, "batch2_offsets": fx.Batch2Offsets} {
		if len(offs) != cfg.B {
			bad("%s has %d offsets, want B=%d", name, len(offs), cfg.B)
		}
		for _, o := range offs {
			if o < 0 || o >= cfg.OffsetRange() {
				bad("%s: offset %d outside [0, %d)", name, o, cfg.OffsetRange())
			}
		}
	}
	if len(fx.LossCurveEvery20) != len(fx.LossCurveEvery20Steps) || len(fx.LossCurveEvery20) == 0 {
		bad("loss curve has %d values for %d steps", len(fx.LossCurveEvery20), len(fx.LossCurveEvery20Steps))
	}
	for _, s := range fx.LossCurveEvery20Steps {
		if s < 1 || s > cfg.Steps {
			bad("loss curve step %d outside [1, %d]", s, cfg.Steps)
		}
	}
	for name, v := range map[string]float64{
		"loss_step1": fx.LossStep1, "loss_step1_f64": fx.LossStep1F64, "loss_step2": fx.LossStep2,
		"grad_norm_step1": fx.GradNormStep1, "uniform_loss_ln256": fx.UniformLossLn256,
		"tolerances.loss_step1_rel": fx.Tolerances.LossStep1Rel, "tolerances.loss_step2_rel": fx.Tolerances.LossStep2Rel,
		"tolerances.grad_rel_l2_per_param":              fx.Tolerances.GradRelL2PerParam,
		"tolerances.after1_max_abs_given_fixture_grads": fx.Tolerances.After1MaxAbsGivenFixtureGrads,
		"tolerances.after1_max_abs_end_to_end":          fx.Tolerances.After1MaxAbsEndToEnd,
		"tolerances.loss_curve_abs_steps_le_100":        fx.Tolerances.LossCurveAbsStepsLE100,
		"tolerances.loss_curve_abs_steps_gt_100":        fx.Tolerances.LossCurveAbsStepsGT100,
		"tolerances.loss_curve_abs_last_step":           fx.Tolerances.LossCurveAbsLastStep,
	} {
		if !(v > 0) {
			bad("%s=%v must be positive (missing?)", name, v)
		}
	}
	return errors.Join(errs...)
}

// Cfg returns the fixture's configuration as a Config. LoadFixture has
// already checked it, so the error is non-nil only for a Fixture built by
// hand.
func (fx *Fixture) Cfg() (Config, error) { return fx.Config.Config() }

// readFile reads the fixture's file name (the tensors or the
// specification).
func (fx *Fixture) readFile(name string) ([]byte, error) {
	if fx.fsys == nil {
		return nil, fmt.Errorf("tinygpt: fixture parsed without its files: cannot read %s", name)
	}
	b, err := fs.ReadFile(fx.fsys, name)
	if err != nil {
		return nil, fmt.Errorf("tinygpt: %w", err)
	}
	return b, nil
}

// Spec returns the text of the fixture's specification (reference/TINY_GPT.md).
func (fx *Fixture) Spec() ([]byte, error) { return fx.readFile(fx.SpecFile) }

// Tensors opens the fixture's tensor file after checking its size and
// SHA-256 against the JSON (VerifySafetensors).
func (fx *Fixture) Tensors() (*safetensors.File, error) {
	b, err := fx.readFile(fx.Safetensors)
	if err != nil {
		return nil, err
	}
	if err := fx.verify(b); err != nil {
		return nil, err
	}
	f, err := safetensors.Read(bytes.NewReader(b), int64(len(b)))
	if err != nil {
		return nil, fmt.Errorf("tinygpt: %s: %w", fx.Safetensors, err)
	}
	return f, nil
}

// LossAt returns the reference training loss at step (the loss of batch step
// before update step): LossStep1 at step 1, LossStep2 at step 2, and the
// curve values at its steps; ok is false for other steps.
func (fx *Fixture) LossAt(step int) (loss float64, ok bool) {
	switch step {
	case 1:
		return fx.LossStep1, true
	case 2:
		return fx.LossStep2, true
	}
	for i, s := range fx.LossCurveEvery20Steps {
		if s == step {
			return fx.LossCurveEvery20[i], true
		}
	}
	return 0, false
}

// Offsets returns the reference offsets of batch step (1 or 2), or nil.
func (fx *Fixture) Offsets(step int) []int {
	switch step {
	case 1:
		return fx.Batch1Offsets
	case 2:
		return fx.Batch2Offsets
	}
	return nil
}

// VerifySafetensors checks the size and SHA-256 of the tensor file against
// safetensors_bytes and safetensors_sha256; it does not parse the file.
func (fx *Fixture) VerifySafetensors() error {
	b, err := fx.readFile(fx.Safetensors)
	if err != nil {
		return err
	}
	return fx.verify(b)
}

func (fx *Fixture) verify(b []byte) error {
	if int64(len(b)) != fx.SafetensorsBytes {
		return fmt.Errorf("tinygpt: %s has %d bytes, fixture says %d", fx.Safetensors, len(b), fx.SafetensorsBytes)
	}
	if got := CorpusSHA256(b); got != fx.SafetensorsSHA256 {
		return fmt.Errorf("tinygpt: %s has SHA-256 %s, fixture says %s", fx.Safetensors, got, fx.SafetensorsSHA256)
	}
	return nil
}

// CorpusSHA256 returns the lowercase hex SHA-256 of corpus (or of any
// bytes), the form of the fixture's corpus_sha256 and safetensors_sha256.
func CorpusSHA256(corpus []byte) string {
	s := sha256.Sum256(corpus)
	return hex.EncodeToString(s[:])
}

// Params reads the float32 tensors prefix+name for every parameter of the
// fixture's configuration (prefix is PrefixInit, PrefixGrad1 or
// PrefixAfter1) from the fixture's safetensors file, checking each shape.
func (fx *Fixture) Params(prefix string) (map[string][]float32, error) {
	cfg, err := fx.Cfg()
	if err != nil {
		return nil, err
	}
	f, err := fx.Tensors()
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := make(map[string][]float32)
	for _, p := range cfg.Params() {
		tn, err := f.Tensor(prefix + p.Name)
		if err != nil {
			return nil, fmt.Errorf("tinygpt: %w", err)
		}
		if !slices.Equal(tn.Shape, p.Shape) {
			return nil, fmt.Errorf("tinygpt: %s%s has shape %v, want %v", prefix, p.Name, tn.Shape, p.Shape)
		}
		if out[p.Name], err = tn.Float32s(); err != nil {
			return nil, fmt.Errorf("tinygpt: %s%s: %w", prefix, p.Name, err)
		}
	}
	return out, nil
}
