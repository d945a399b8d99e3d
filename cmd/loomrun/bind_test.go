package main

import (
	"io"
	"slices"
	"strings"
	"testing"
)

func TestPlanCPUs(t *testing.T) {
	cases := []struct {
		allowed []int
		nproc   int
		want    [][]int // nil: not bound
	}{
		{[]int{0, 1}, 2, [][]int{{0}, {1}}},
		{[]int{0, 1}, 1, [][]int{{0, 1}}},
		{[]int{0, 1, 2, 3, 4, 5, 6, 7}, 4, [][]int{{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
		{[]int{2, 3, 5, 7, 11}, 2, [][]int{{2, 3}, {5, 7}}}, // a leftover CPU stays unused
		{[]int{0, 1}, 3, nil},                               // more ranks than CPUs
		{nil, 1, nil},
	}
	for _, tc := range cases {
		got, why := planCPUs(tc.allowed, tc.nproc)
		if !slices.EqualFunc(got, tc.want, slices.Equal) || (got == nil) != (tc.want == nil) {
			t.Errorf("planCPUs(%v, %d) = %v, want %v", tc.allowed, tc.nproc, got, tc.want)
		}
		if (got == nil) != (why != "") {
			t.Errorf("planCPUs(%v, %d): reason %q with plan %v", tc.allowed, tc.nproc, why, got)
		}
	}
}

func TestParseCPUs(t *testing.T) {
	for _, cpus := range [][]int{{0}, {3, 4, 9}} {
		got, err := parseCPUs(formatCPUs(cpus))
		if err != nil || !slices.Equal(got, cpus) {
			t.Errorf("parseCPUs(formatCPUs(%v)) = %v, %v", cpus, got, err)
		}
	}
	for _, bad := range []string{"", "a", "1,,2", "-1", "70000"} {
		if _, err := parseCPUs(bad); err == nil {
			t.Errorf("parseCPUs(%q): no error", bad)
		}
	}
}

func TestParseArgsBind(t *testing.T) {
	cases := []struct {
		env  string // LOOM_BIND
		args []string
		want string // "": an error
	}{
		{"", []string{"p"}, bindCore},
		{"none", []string{"p"}, bindNone},
		{" FALSE ", []string{"p"}, bindNone},
		{"0", []string{"p"}, bindNone},
		{"1", []string{"p"}, bindCore},
		{"auto", []string{"p"}, bindCore},
		{"none", []string{"--bind", "core", "p"}, bindCore},
		{"", []string{"--bind", "none", "p"}, bindNone},
		{"numa", []string{"--bind", "none", "p"}, bindNone}, // the flag overrides a bad LOOM_BIND
		{"", []string{"--bind", "socket", "p"}, ""},
		{"", []string{"--bind", "1", "p"}, ""},
		{"numa", []string{"p"}, ""},
	}
	for _, tc := range cases {
		t.Setenv(bindEnv, tc.env)
		cfg, err := parseArgs(tc.args, io.Discard)
		switch {
		case tc.want == "" && err == nil:
			t.Errorf("LOOM_BIND=%q %v: no error", tc.env, tc.args)
		case tc.want == "" && !strings.Contains(err.Error(), "want "):
			t.Errorf("LOOM_BIND=%q %v: %v", tc.env, tc.args, err)
		case tc.want != "" && (err != nil || cfg.bind != tc.want):
			t.Errorf("LOOM_BIND=%q %v: bind %v, %v; want %s", tc.env, tc.args, cfg, err, tc.want)
		}
	}
}
