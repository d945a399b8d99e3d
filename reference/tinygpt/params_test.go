package tinygpt

import (
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

func TestParamsDefault(t *testing.T) {
	c := Default()
	ps := c.Params()
	if len(ps) != 29 {
		t.Fatalf("%d parameters, want 29", len(ps))
	}
	if n := c.NumParams(); n != 470528 {
		t.Errorf("NumParams() = %d, want 470528", n)
	}
	for _, tc := range []struct {
		name  string
		shape []int
		init  Init
	}{
		{"wte", []int{256, 128}, InitNormal},
		{"wpe", []int{64, 128}, InitNormal},
		{"h.0.ln1.weight", []int{128}, InitOnes},
		{"h.1.attn.qkv.weight", []int{384, 128}, InitNormal},
		{"h.1.attn.qkv.bias", []int{384}, InitZeros},
		{"h.0.mlp.fc.weight", []int{512, 128}, InitNormal},
		{"h.0.mlp.proj.weight", []int{128, 512}, InitNormal},
		{"ln_f.bias", []int{128}, InitZeros},
		{"lm_head.weight", []int{256, 128}, InitNormal},
	} {
		p, err := c.Param(tc.name)
		if err != nil {
			t.Error(err)
			continue
		}
		if !slices.Equal(p.Shape, tc.shape) || p.Init != tc.init {
			t.Errorf("%s: shape %v init %v, want %v %v", tc.name, p.Shape, p.Init, tc.shape, tc.init)
		}
	}
	if _, err := c.Param("h.2.ln1.weight"); err == nil {
		t.Error(`Param("h.2.ln1.weight") succeeded for L=2`)
	}
	if _, err := c.Param("lm_head.bias"); err == nil {
		t.Error("lm_head has a bias")
	}
}

func TestParamsOtherConfigs(t *testing.T) {
	for _, tc := range []struct {
		name            string
		c               Config
		count, numel    int
		last, lastBlock string
	}{
		{"L=0", Config{V: 256, D: 8, H: 2, L: 0, F: 16, T: 4}, 5, 256*8*2 + 4*8 + 2*8, "lm_head.weight", ""},
		{"L=1", Config{V: 256, D: 8, H: 2, L: 1, F: 16, T: 4}, 17,
			256*8*2 + 4*8 + 2*8 + (4*8 + 3*8*8 + 3*8 + 8*8 + 8 + 16*8 + 16 + 8*16 + 8), "lm_head.weight", "h.0.mlp.proj.bias"},
		{"L=3", func() Config { c := Default(); c.L = 3; return c }(), 41,
			470528 + (470528-256*128*2-64*128-2*128)/2, "lm_head.weight", "h.2.mlp.proj.bias"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ps := tc.c.Params()
			if len(ps) != tc.count || tc.c.NumParams() != tc.numel {
				t.Fatalf("%d parameters, %d scalars; want %d, %d", len(ps), tc.c.NumParams(), tc.count, tc.numel)
			}
			if ps[len(ps)-1].Name != tc.last {
				t.Errorf("last parameter %q", ps[len(ps)-1].Name)
			}
			if tc.lastBlock != "" && ps[len(ps)-4].Name != tc.lastBlock {
				t.Errorf("last block parameter %q, want %q", ps[len(ps)-4].Name, tc.lastBlock)
			}
			if n := len(tc.c.FixtureTensors()); n != 3*tc.count+2 {
				t.Errorf("%d fixture tensors, want %d", n, 3*tc.count+2)
			}
		})
	}
}

func TestParamsMatchFixture(t *testing.T) {
	fx := loadFixture(t)
	c, err := fx.Cfg()
	if err != nil {
		t.Fatal(err)
	}
	if names := c.ParamNames(); !slices.Equal(names, fx.ParamOrder) {
		t.Errorf("ParamNames()\n %v\n!= param_order\n %v", names, fx.ParamOrder)
	}
	for _, p := range c.Params() {
		if !slices.Equal(p.Shape, fx.ParamShapes[p.Name]) {
			t.Errorf("%s: shape %v, param_shapes %v", p.Name, p.Shape, fx.ParamShapes[p.Name])
		}
		// The init kinds against the initial norms: ones give sqrt(numel),
		// zeros 0, N(0, σ²) about σ·sqrt(numel).
		got := fx.InitNorms[p.Name]
		n := float64(p.Numel())
		switch p.Init {
		case InitOnes:
			if math.Abs(got-math.Sqrt(n)) > 1e-9 {
				t.Errorf("%s: init norm %v, ones give %v", p.Name, got, math.Sqrt(n))
			}
		case InitZeros:
			if got != 0 {
				t.Errorf("%s: init norm %v, zeros give 0", p.Name, got)
			}
		case InitNormal:
			if want := c.InitStd * math.Sqrt(n); math.Abs(got/want-1) > 0.05 {
				t.Errorf("%s: init norm %v, N(0, %v²) gives about %v", p.Name, got, c.InitStd, want)
			}
		}
	}
	if c.NumParams() != fx.NParams {
		t.Errorf("NumParams() = %d, n_params = %d", c.NumParams(), fx.NParams)
	}
}

// specParamTable parses the table of reference/TINY_GPT.md §3.1 into rows of names,
// symbolic shapes and init kinds, in table order, with the block rows marked.
type specRow struct {
	name  string
	shape string
	init  string
	block bool
}

func parseSpecParamTable(t *testing.T, spec string) []specRow {
	t.Helper()
	start := strings.Index(spec, "### 3.1 Parameters")
	end := strings.Index(spec, "### 3.2")
	if start < 0 || end < start {
		t.Fatal("TINY_GPT.md has no §3.1")
	}
	var (
		rows    []specRow
		inBlock bool
		names   = regexp.MustCompile("`([^`]+)`")
		shapes  = regexp.MustCompile(`\[[^\]]*\]`)
		inits   = regexp.MustCompile(`N\([^)]*\)|\b[01]\b`)
	)
	for _, line := range strings.Split(spec[start:end], "\n") {
		cells := strings.Split(line, "|")
		if len(cells) != 5 || strings.HasPrefix(strings.TrimSpace(cells[1]), "name") || strings.HasPrefix(strings.TrimSpace(cells[1]), "---") {
			continue
		}
		if strings.Contains(cells[1], "prefix") {
			inBlock = true
			continue
		}
		// The table does not mark the end of the block rows; the prose after
		// it says the order ends with ln_f.weight, ln_f.bias, lm_head.weight.
		if strings.HasPrefix(strings.TrimSpace(cells[1]), "`ln_f") {
			inBlock = false
		}
		ns := names.FindAllStringSubmatch(cells[1], -1)
		ss := shapes.FindAllString(cells[2], -1)
		is := inits.FindAllString(cells[3], -1)
		if len(ns) == 0 || len(ns) != len(ss) || len(ns) != len(is) {
			t.Fatalf("cannot parse §3.1 row %q", line)
		}
		for i, n := range ns {
			rows = append(rows, specRow{n[1], ss[i], is[i], inBlock})
		}
	}
	return rows
}

// evalShape turns "[3D, D]" into numbers for c.
func evalShape(t *testing.T, s string, c Config) []int {
	t.Helper()
	sym := map[string]int{"V": c.V, "D": c.D, "F": c.F, "T": c.T, "H": c.H, "L": c.L}
	dim := regexp.MustCompile(`^(\d*)([A-Z]+)$`)
	var out []int
	for _, d := range strings.Split(strings.Trim(s, "[]"), ",") {
		m := dim.FindStringSubmatch(strings.TrimSpace(d))
		if m == nil {
			t.Fatalf("cannot parse dimension %q of %s", d, s)
		}
		v, ok := sym[m[2]]
		if !ok {
			t.Fatalf("cannot evaluate dimension %q of %s", d, s)
		}
		if m[1] != "" {
			k, _ := strconv.Atoi(m[1])
			v *= k
		}
		out = append(out, v)
	}
	return out
}

func TestParamsMatchSpecTable(t *testing.T) {
	spec := readSpec(t)
	rows := parseSpecParamTable(t, spec)
	if len(rows) != 17 {
		t.Fatalf("§3.1 table has %d parameter names, want 2 + 12 + 3", len(rows))
	}
	initOf := map[string]Init{"N(0, 0.02²)": InitNormal, "1": InitOnes, "0": InitZeros}
	for _, c := range []Config{Default(), {V: 300, D: 12, H: 3, L: 3, F: 20, T: 7}} {
		// Expand the table in the documented order: the rows before the
		// block marker, every block in turn, then the rows after it.
		var want []Param
		var pre, blk, post []specRow
		for _, r := range rows {
			switch {
			case r.block:
				blk = append(blk, r)
			case len(blk) == 0:
				pre = append(pre, r)
			default:
				post = append(post, r)
			}
		}
		add := func(prefix string, rs []specRow) {
			for _, r := range rs {
				in, ok := initOf[r.init]
				if !ok {
					t.Fatalf("unknown init %q of %s", r.init, r.name)
				}
				want = append(want, Param{prefix + r.name, evalShape(t, r.shape, c), in})
			}
		}
		for _, side := range []struct {
			re   string
			rows []specRow
		}{{"The full order is `([^`]+)`", pre}, {"any later blocks, then `([^`]+)`", post}} {
			m := regexp.MustCompile(side.re).FindStringSubmatch(strings.Join(strings.Fields(spec), " "))
			var names []string
			for _, r := range side.rows {
				names = append(names, r.name)
			}
			if m == nil || strings.Join(names, ", ") != m[1] {
				t.Fatalf("table rows %v do not match the order the prose gives (%v)", names, m)
			}
		}
		add("", pre)
		for l := range c.L {
			add("h."+strconv.Itoa(l)+".", blk)
		}
		add("", post)
		got := c.Params()
		if len(got) != len(want) {
			t.Fatalf("L=%d: %d parameters, the spec table gives %d", c.L, len(got), len(want))
		}
		for i := range want {
			if got[i].Name != want[i].Name || !slices.Equal(got[i].Shape, want[i].Shape) || got[i].Init != want[i].Init {
				t.Errorf("parameter %d: %+v, spec %+v", i, got[i], want[i])
			}
		}
	}
	m := regexp.MustCompile(`configuration has ([0-9,]+) parameters`).FindStringSubmatch(spec)
	if m == nil {
		t.Fatal("TINY_GPT.md does not state the parameter count")
	}
	if n, _ := strconv.Atoi(strings.ReplaceAll(m[1], ",", "")); n != Default().NumParams() {
		t.Errorf("spec says %s parameters, NumParams() = %d", m[1], Default().NumParams())
	}
}

func TestFixtureTensors(t *testing.T) {
	c := Default()
	ts := c.FixtureTensors()
	if len(ts) != 89 {
		t.Fatalf("%d tensors, want 29·3 + 2 = 89", len(ts))
	}
	for _, tc := range []struct {
		i     int
		name  string
		dtype string
		shape []int
	}{
		{0, "x1", "I64", []int{16, 64}},
		{1, "y1", "I64", []int{16, 64}},
		{2, "init.wte", "F32", []int{256, 128}},
		{30, "init.lm_head.weight", "F32", []int{256, 128}},
		{31, "grad1.wte", "F32", []int{256, 128}},
		{31 + 4, "grad1.h.0.attn.qkv.weight", "F32", []int{384, 128}},
		{88, "after1.lm_head.weight", "F32", []int{256, 128}},
	} {
		if got := ts[tc.i]; got.Name != tc.name || got.DType != tc.dtype || !slices.Equal(got.Shape, tc.shape) {
			t.Errorf("tensor %d = %+v, want %s %s %v", tc.i, got, tc.name, tc.dtype, tc.shape)
		}
	}
	seen := map[string]bool{}
	for _, ts := range ts {
		if seen[ts.Name] {
			t.Errorf("duplicate tensor %s", ts.Name)
		}
		seen[ts.Name] = true
	}
}

func TestMetadataKeysInSpec(t *testing.T) {
	spec := readSpec(t)
	i := strings.Index(spec, "`__metadata__` keys:")
	if i < 0 {
		t.Fatal("TINY_GPT.md §5.1 lists no metadata keys")
	}
	i += len("`__metadata__` keys:")
	line := spec[i : i+strings.Index(spec[i:], "\n\n")]
	var want []string
	for _, m := range regexp.MustCompile("`([a-z_0-9]+)`").FindAllStringSubmatch(line, -1) {
		want = append(want, m[1])
	}
	if !slices.Equal(MetadataKeys(), want) {
		t.Errorf("MetadataKeys() = %v, spec lists %v", MetadataKeys(), want)
	}
}

func TestInitString(t *testing.T) {
	for _, tc := range []struct {
		in   Init
		want string
	}{{InitNormal, "N(0, σ²)"}, {InitOnes, "1"}, {InitZeros, "0"}, {Init(7), "Init(7)"}} {
		if got := tc.in.String(); got != tc.want {
			t.Errorf("%d.String() = %q, want %q", int(tc.in), got, tc.want)
		}
	}
}
