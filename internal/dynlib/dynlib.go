// Package dynlib opens shared libraries at run time and binds their entry
// points to Go function variables, without cgo: it calls dlopen and dlsym
// through github.com/ebitengine/purego. It is the loader behind package
// kernels (OpenBLAS, BLIS and other CBLAS libraries), device/cuda (the CUDA
// driver and NVRTC) and comm/nccl (NCCL and the CUDA driver).
//
// Loading one library takes three steps:
//
//   - A [Spec] is what an option or an environment variable asks for: ""
//     for the default search, [Off] for no library at all, or a soname or
//     path that is then the only candidate. [SpecFrom] picks the option
//     when it was given and the environment variable otherwise, and
//     [Spec.Search] turns the spec into a [Search].
//   - [First] tries the candidates of a Search in order. It dlopens each
//     one and hands it to a bind function, which binds the entry points
//     with [Library.Bind]; the first candidate that opens and binds is
//     kept, the others are closed. Every candidate tried is reported as an
//     [Attempt] with the reason it was rejected, and when none is kept the
//     error is a [*LoadError] listing them.
//   - [Library.Bind] binds [Symbol]s, required or optional; when required
//     ones are missing it returns a [*SymbolError] naming them.
//
// Libraries are opened with RTLD_NOW | RTLD_LOCAL. Loading is implemented
// on linux/amd64 and linux/arm64 ([Supported]); on other platforms every
// candidate is rejected with an error matching [errors.ErrUnsupported].
package dynlib

import (
	"fmt"
	"os"
	"strings"
)

// Off is the spec that loads no library. [Spec.Off] compares it without
// regard to case.
const Off = "off"

// Spec is what the user asked for one library: "" for the default search,
// [Off] for none, or a soname or path, which is then the only candidate.
type Spec string

// SpecFrom returns the spec of a library that an option and an environment
// variable can both force: value when set is true (the option was given,
// possibly as ""), else the value of the environment variable env with
// surrounding white space removed.
func SpecFrom(value string, set bool, env string) Spec {
	if set {
		return Spec(value)
	}
	return Spec(strings.TrimSpace(os.Getenv(env)))
}

// Off reports whether s is [Off], in any case.
func (s Spec) Off() bool { return strings.EqualFold(string(s), Off) }

// Forced reports whether s names a library: it is neither "" nor [Off].
func (s Spec) Forced() bool { return s != "" && !s.Off() }

// Search returns the search that s asks for: the one name s when it is
// forced, defaults when s is "", and a disabled search when s is [Off].
// library labels the attempts and errors (for example "driver").
func (s Spec) Search(library string, defaults ...string) Search {
	switch {
	case s.Off():
		return Search{Library: library, Disabled: true}
	case s != "":
		return Search{Library: library, Names: []string{string(s)}, Forced: true}
	}
	return Search{Library: library, Names: defaults}
}

// Search is the list of candidates for one library that [First] tries.
type Search struct {
	// Library labels the library in attempts and errors, e.g. "nvrtc".
	Library string
	// Names are the sonames and paths to try, in order.
	Names []string
	// Forced records that the user chose Names (a [LoadError] says so).
	Forced bool
	// Disabled means that the user turned the library off: First tries
	// nothing and fails.
	Disabled bool
}

// Attempt is one candidate that [First] tried.
type Attempt struct {
	// Library is the [Search.Library] the candidate was tried for.
	Library string
	// Name is the soname or path passed to dlopen.
	Name string
	// Err says why the candidate was rejected; nil for the one kept.
	Err error
}

// String formats the attempt as "driver libcuda.so.1: ok" or with the
// reason it was rejected.
func (a Attempt) String() string {
	if a.Err == nil {
		return a.Library + " " + a.Name + ": ok"
	}
	return a.Library + " " + a.Name + ": " + a.Err.Error()
}

// AttemptsAs converts attempts to A, a package's own attempt type with the
// same fields as [Attempt], so that packages can report attempts in their
// API without exposing this package.
func AttemptsAs[A ~struct {
	Library string
	Name    string
	Err     error
}](tried []Attempt) []A {
	out := make([]A, len(tried))
	for i, a := range tried {
		out[i] = A(a)
	}
	return out
}

// LoadError is returned by [First] when no candidate could be used.
type LoadError struct {
	// Library is the [Search.Library] that did not load.
	Library string
	// Forced is true when the user chose the candidates.
	Forced bool
	// Disabled is true when the library was turned off ([Off]); then
	// nothing was tried.
	Disabled bool
	// Tried lists the candidates in the order they were tried, each with
	// the reason it was rejected.
	Tried []Attempt
}

// Error lists the candidates and the reasons they were rejected.
func (e *LoadError) Error() string {
	if e.Disabled {
		return "dynlib: " + e.Library + " is disabled (" + Off + ")"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "dynlib: no %s library could be loaded", e.Library)
	if e.Forced {
		b.WriteString(" (forced)")
	}
	b.WriteString("; tried")
	for i, a := range e.Tried {
		if i > 0 {
			b.WriteString(";")
		}
		fmt.Fprintf(&b, " %s (%v)", a.Name, a.Err)
	}
	if len(e.Tried) == 0 {
		b.WriteString(" nothing")
	}
	return b.String()
}

// Unwrap returns the reasons the candidates were rejected, so that
// errors.Is sees through to them (errors.ErrUnsupported, a [*SymbolError]).
func (e *LoadError) Unwrap() []error {
	var errs []error
	for _, a := range e.Tried {
		if a.Err != nil {
			errs = append(errs, a.Err)
		}
	}
	return errs
}

// Symbol is one entry point for [Library.Bind] to bind.
type Symbol struct {
	// Name is the C symbol.
	Name string
	// Fn receives it: a pointer to a Go function variable, which is bound
	// to call the symbol (purego.RegisterFunc), or a *uintptr, which is
	// set to the symbol's address.
	Fn any
	// Optional symbols may be missing; their Fn is then left as it is.
	Optional bool
}

// SymbolError is returned by [Library.Bind] when required symbols are
// missing from the library.
type SymbolError struct {
	// Library is the soname or path the library was opened as.
	Library string
	// Missing are the required symbols not found, in the order given.
	Missing []string
}

// Error names the missing symbols: "missing symbols cuInit, cuMemAlloc_v2".
func (e *SymbolError) Error() string {
	return "missing symbols " + strings.Join(e.Missing, ", ")
}

// Library is an open shared library. Its methods other than Close may be
// called concurrently; Bind writes the function variables it is given, so
// bind before sharing them.
type Library struct {
	name   string
	handle uintptr
}

// Open dlopens name, a soname or a path. The library stays loaded until
// [Library.Close]; libraries that start threads of their own (BLAS, the
// CUDA driver, NCCL) must never be closed.
func Open(name string) (*Library, error) {
	h, err := dlopen(name)
	if err != nil {
		return nil, err
	}
	return &Library{name: name, handle: h}, nil
}

// Name returns the soname or path that the library was opened as.
func (l *Library) Name() string { return l.name }

// Bind looks up every symbol of syms and binds it to its Fn. It returns a
// [*SymbolError] naming the required symbols that are missing, having bound
// the others; a Fn that purego cannot bind (not a pointer to a function
// variable of a signature it supports) is returned as an error too.
func (l *Library) Bind(syms []Symbol) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("binding: %v", r)
		}
	}()
	var missing []string
	for _, s := range syms {
		addr, ok := dlsym(l.handle, s.Name)
		if !ok {
			if !s.Optional {
				missing = append(missing, s.Name)
			}
			continue
		}
		if p, ok := s.Fn.(*uintptr); ok {
			*p = addr
			continue
		}
		registerFunc(s.Fn, addr)
	}
	if len(missing) > 0 {
		return &SymbolError{Library: l.name, Missing: missing}
	}
	return nil
}

// Path returns the file the library was loaded from: the file mapped at
// the address of symbol (/proc/self/maps), which resolves sonames and
// symbolic links, or the name it was opened as when that cannot be found.
func (l *Library) Path(symbol string) string {
	if addr, ok := dlsym(l.handle, symbol); ok {
		if p := mappedFile(addr); p != "" {
			return p
		}
	}
	return l.name
}

// Close dlcloses the library. Functions bound from it must not be called
// afterwards.
func (l *Library) Close() error { return dlclose(l.handle) }

// First tries the candidates of s in order: it opens each one and calls
// bind with it, and keeps the first for which both succeed, closing the
// others. It returns bind's result and the library kept, with every
// candidate tried. When none is kept, or s is disabled, the error is a
// [*LoadError].
func First[T any](s Search, bind func(*Library) (T, error)) (T, *Library, []Attempt, error) {
	var zero T
	if s.Disabled {
		return zero, nil, nil, &LoadError{Library: s.Library, Disabled: true}
	}
	var tried []Attempt
	for _, name := range s.Names {
		v, lib, err := try(name, bind)
		tried = append(tried, Attempt{Library: s.Library, Name: name, Err: err})
		if err == nil {
			return v, lib, tried, nil
		}
	}
	return zero, nil, tried, &LoadError{Library: s.Library, Forced: s.Forced, Tried: tried}
}

// BindNew returns a bind function for [First] that binds the symbols that
// syms lists for a new T (typically a struct of function variables) and
// returns that T.
func BindNew[T any](syms func(*T) []Symbol) func(*Library) (*T, error) {
	return func(l *Library) (*T, error) {
		v := new(T)
		if err := l.Bind(syms(v)); err != nil {
			return nil, err
		}
		return v, nil
	}
}

// try opens name and binds it, closing it when bind fails.
func try[T any](name string, bind func(*Library) (T, error)) (T, *Library, error) {
	var zero T
	lib, err := Open(name)
	if err != nil {
		return zero, nil, err
	}
	v, err := bind(lib)
	if err != nil {
		_ = lib.Close()
		return zero, nil, err
	}
	return v, lib, nil
}
