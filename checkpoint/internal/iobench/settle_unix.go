//go:build unix

package main

import "syscall"

// settle writes out what earlier writes and removals left pending
// (sync(2)), so that the next timed write does not pay for them.
func settle() { syscall.Sync() }
