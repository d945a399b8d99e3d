package cuda

// Lib returns the library the context was opened from, so that a library
// built on this binding (comm/nccl) can check that a context is one of
// its own driver's.
func (c *Context) Lib() *Lib { return c.lib }

// Run calls f on an OS thread locked for the call with c current, for
// calls into libraries that work in the thread's current context (NCCL).
// It fails, without calling f, when c or its Lib is closed or nil (an
// error matching [ErrInvalid]) or the context cannot be made current (an
// [*Error]); otherwise it returns f's error as is. f must not call c's
// methods, which take the same locks.
func (c *Context) Run(f func() error) error {
	return c.do("Run", func(*driverFns) error { return f() })
}
