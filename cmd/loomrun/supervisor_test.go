//go:build unix

package main

import (
	"errors"
	"reflect"
	"testing"
)

func TestParseStatus(t *testing.T) {
	for _, tc := range []struct {
		line string
		want rankEvent
	}{
		{"started 4242", rankEvent{kind: evStarted, pgid: 4242}},
		{"exited 0", rankEvent{kind: evExited}},
		{"exited 3", rankEvent{kind: evExited, exit: rankExit{code: 3}}},
		{"signaled 9", rankEvent{kind: evExited, exit: rankExit{signal: 9}}},
		{"leftover 2", rankEvent{kind: evLeftover, n: 2}},
		{"leftover -1", rankEvent{kind: evLeftover, n: -1}},
		{"note a b c", rankEvent{kind: evNote, msg: "a b c"}},
		{"failed exec format error", rankEvent{kind: evFailed, err: errors.New("exec format error")}},
		// Malformed lines are logged, never trusted.
		{"started 0", rankEvent{kind: evNote, msg: `malformed status line from the supervisor: "started 0"`}},
		{"started x", rankEvent{kind: evNote, msg: `malformed status line from the supervisor: "started x"`}},
		{"signaled -1", rankEvent{kind: evNote, msg: `malformed status line from the supervisor: "signaled -1"`}},
		{"exited", rankEvent{kind: evNote, msg: `malformed status line from the supervisor: "exited"`}},
		{"bogus 1", rankEvent{kind: evNote, msg: `malformed status line from the supervisor: "bogus 1"`}},
	} {
		if got := parseStatus(tc.line); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parseStatus(%q) = %+v, want %+v", tc.line, got, tc.want)
		}
	}
}

func TestRankExitDescribe(t *testing.T) {
	for _, tc := range []struct {
		e      rankExit
		desc   string
		failed bool
	}{
		{rankExit{}, "exited with status 0", false},
		{rankExit{code: 3}, "exited with status 3", true},
		{rankExit{signal: 15}, "was killed by signal SIGTERM (15)", true},
		{rankExit{signal: 9}, "was killed by signal SIGKILL (9)", true},
	} {
		if desc, failed := tc.e.describe(); desc != tc.desc || failed != tc.failed {
			t.Errorf("%+v: %q, %v; want %q, %v", tc.e, desc, failed, tc.desc, tc.failed)
		}
	}
}
