package comm

import (
	"errors"
	"maps"
	"strings"
	"testing"
	"time"
)

// FuzzParseAlgorithmOverrides checks that any string either parses to
// overrides that String formats back to the same overrides, or fails with
// an ErrInvalid error that quotes the input.
func FuzzParseAlgorithmOverrides(f *testing.F) {
	for _, s := range []string{
		"", " ", "ring", "AUTO", "allreduce=ring", "allreduce=ring,allreduce=tree", "ring,tree",
		"ring, allgather = direct ,broadcast=dbtree", ",", "ring,", "=", "allreduce=", "=ring",
		"allreduce=ring=tree", "hier,alltoallv=halving-doubling", "reduce\x00=ring", "allreduce=ring,,allgather=rd",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		o, err := ParseAlgorithmOverrides(s)
		if err != nil {
			if o != nil || !errors.Is(err, ErrInvalid) || !strings.HasPrefix(err.Error(), "comm: ParseAlgorithmOverrides(") {
				t.Fatalf("ParseAlgorithmOverrides(%q) = %v, %v: want nil and an ErrInvalid error quoting the input", s, o, err)
			}
			return
		}
		for op, a := range o {
			if _, known := opNames[op]; (!known && op != 0) || !a.Valid() {
				t.Fatalf("ParseAlgorithmOverrides(%q) = %v: unknown op or algorithm", s, o)
			}
		}
		again, err := ParseAlgorithmOverrides(o.String())
		if err != nil || !maps.Equal(again, o) {
			t.Fatalf("ParseAlgorithmOverrides(%q) = %v, whose String %q parses to %v, %v", s, o, o.String(), again, err)
		}
	})
}

// FuzzOptionsFromEnv checks that any values of LOOM_DEBUG, LOOM_TIMEOUT and
// LOOM_ALGO either give Options that say what the values say, or an
// ErrInvalid error naming a variable that was set.
func FuzzOptionsFromEnv(f *testing.F) {
	f.Add("", "", "")
	f.Add("consistency", "30s", "ring")
	f.Add("consistency,consistency", "1h2m3.5s", "allreduce=ring,allreduce=tree")
	f.Add(" consistency ,", "-1s", "ring,tree")
	f.Add("trace", "0", "allgather=direct")
	f.Add(" ", "9223372036854775807ns", "\t")
	f.Fuzz(func(t *testing.T, debug, timeout, algo string) {
		env := map[string]string{DebugEnv: debug, TimeoutEnv: timeout, AlgorithmEnv: algo}
		o, err := optionsFrom(func(k string) string { return env[k] })
		if err != nil {
			named := false
			for k, v := range env {
				named = named || v != "" && strings.HasPrefix(err.Error(), "comm: "+k+"=")
			}
			if !named || !errors.Is(err, ErrInvalid) {
				t.Fatalf("env %q: error %v: want an ErrInvalid error naming a variable that was set", env, err)
			}
			return
		}
		if want := strings.TrimSpace(debug) != ""; o.ConsistencyCheck != want {
			t.Fatalf("%s=%q: ConsistencyCheck %v", DebugEnv, debug, o.ConsistencyCheck)
		}
		if strings.TrimSpace(timeout) == "" {
			if o.Timeout != 0 {
				t.Fatalf("%s=%q: Timeout %v, want 0", TimeoutEnv, timeout, o.Timeout)
			}
		} else if d, err := time.ParseDuration(o.Timeout.String()); o.Timeout <= 0 || err != nil || d != o.Timeout {
			t.Fatalf("%s=%q: Timeout %v, which formats to %q and parses to %v, %v", TimeoutEnv, timeout, o.Timeout, o.Timeout.String(), d, err)
		}
		if want, err := ParseAlgorithmOverrides(algo); err != nil || !maps.Equal(o.Algorithms, want) {
			t.Fatalf("%s=%q: Algorithms %v, ParseAlgorithmOverrides gives %v, %v", AlgorithmEnv, algo, o.Algorithms, want, err)
		}
	})
}
