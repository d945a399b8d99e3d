//go:build mpi

package mpi

import (
	"testing"
)

// TestConfigurePrecedence: an option given to New wins over its
// environment variable, the variable applies when no option is given, and
// a malformed variable is an error naming it.
func TestConfigurePrecedence(t *testing.T) {
	cases := []struct {
		name          string
		env           string
		opts          []Option
		hard, wantErr bool
	}{
		{"default", "", nil, false, false},
		{"env on", "1", nil, true, false},
		{"option off beats env on", "true", []Option{WithHardAbort(false)}, false, false},
		{"option on beats env off", "0", []Option{WithHardAbort(true)}, true, false},
		{"malformed env", "maybe", nil, false, true},
		{"malformed env ignored under an option", "maybe", []Option{WithHardAbort(true)}, true, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(HardAbortEnv, c.env)
			cfg, err := configure(c.opts)
			if (err != nil) != c.wantErr {
				t.Fatalf("configure: %v, want error %v", err, c.wantErr)
			}
			if err == nil && cfg.hardAbort != c.hard {
				t.Errorf("hard abort %v, want %v", cfg.hardAbort, c.hard)
			}
		})
	}
}
