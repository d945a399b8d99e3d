package main

import (
	"bytes"
	"fmt"
	"io"
	"sync"
)

// maxLine is the longest line written whole; longer ones are split.
const maxLine = 64 << 10

// syncWriter serializes whole writes to one destination, so lines written
// by different ranks never mix. Write errors are dropped: a closed
// terminal must not stop the children.
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) write(b []byte) {
	s.mu.Lock()
	_, _ = s.w.Write(b) // dropped on purpose, see syncWriter
	s.mu.Unlock()
}

// printf writes one formatted message line.
func (s *syncWriter) printf(format string, args ...any) {
	s.write([]byte(fmt.Sprintf(format, args...)))
}

// lineWriter is the io.Writer given to a child as stdout or stderr: it cuts
// the bytes into lines and writes each, with the prefix, in one write.
// exec calls Write from one goroutine; Flush is called after Wait.
type lineWriter struct {
	dst    *syncWriter
	prefix []byte
	buf    []byte // the current incomplete line
}

func newLineWriter(dst *syncWriter, rank int) *lineWriter {
	return &lineWriter{dst: dst, prefix: []byte(fmt.Sprintf("[rank %d] ", rank))}
}

// Write implements io.Writer; it never fails.
func (w *lineWriter) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			w.buf = append(w.buf, p...)
			for len(w.buf) >= maxLine {
				w.emit(w.buf[:maxLine])
				w.buf = append(w.buf[:0], w.buf[maxLine:]...)
			}
			break
		}
		w.buf = append(w.buf, p[:i]...)
		for len(w.buf) > maxLine {
			w.emit(w.buf[:maxLine])
			w.buf = append(w.buf[:0], w.buf[maxLine:]...)
		}
		w.emit(w.buf)
		w.buf = w.buf[:0]
		p = p[i+1:]
	}
	return n, nil
}

// Flush writes a final line that had no newline.
func (w *lineWriter) Flush() {
	if len(w.buf) > 0 {
		w.emit(w.buf)
		w.buf = w.buf[:0]
	}
}

func (w *lineWriter) emit(line []byte) {
	out := make([]byte, 0, len(w.prefix)+len(line)+1)
	out = append(out, w.prefix...)
	out = append(out, line...)
	out = append(out, '\n')
	w.dst.write(out)
}
