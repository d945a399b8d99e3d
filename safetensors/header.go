package safetensors

import (
	"fmt"
	"unicode/utf16"
	"unicode/utf8"
)

// The header is parsed by a small strict JSON scanner rather than
// encoding/json: the format needs duplicate keys found and object order
// kept, which encoding/json offers only through its token API, at about 60
// allocations and 3 KB per tensor (a 1M-entry header took 17 s and 3 GB);
// and encoding/json turns an unpaired UTF-16 surrogate into U+FFFD, which
// would give the reader names the writer never wrote. The scanner makes one
// pass, allocates per tensor only its slot in a slice, and rejects what the
// JSON grammar (RFC 8259) rejects plus unpaired surrogates.

// maxDepth bounds the nesting of the values the scanner skips (unknown
// fields of an entry), as serde_json, which the reference implementation
// uses, bounds it at 128.
const maxDepth = 128

// syntaxError is a header that is not valid JSON; off is its byte offset in
// the header.
type syntaxError struct {
	off int
	msg string
}

func (e *syntaxError) Error() string { return fmt.Sprintf("byte %d: %s", e.off, e.msg) }

// scanner reads JSON values from b, starting at i.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) errAt(off int, format string, args ...any) error {
	return &syntaxError{off: off, msg: fmt.Sprintf(format, args...)}
}

// unexpected describes the byte at i, or the end of the input.
func (s *scanner) unexpected(want string) error {
	if s.i >= len(s.b) {
		return s.errAt(s.i, "unexpected end of the header, want %s", want)
	}
	return s.errAt(s.i, "unexpected %q, want %s", s.b[s.i], want)
}

// ws skips white space.
func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// peek returns the next byte, or 0 at the end.
func (s *scanner) peek() byte {
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

// consume skips white space and then c, which must come next.
func (s *scanner) consume(c byte) error {
	s.ws()
	if s.peek() != c {
		return s.unexpected(fmt.Sprintf("%q", c))
	}
	s.i++
	s.ws()
	return nil
}

// next skips white space, then a ',' (returning true) or close (returning
// false); anything else is an error.
func (s *scanner) next(close byte) (bool, error) {
	s.ws()
	switch s.peek() {
	case ',':
		s.i++
		s.ws()
		return true, nil
	case close:
		s.i++
		return false, nil
	}
	return false, s.unexpected(fmt.Sprintf("',' or %q", close))
}

// object scans the object at s.i, calling member with each key, decoded
// into scratch, and s.i at the key's value, which member must consume.
func (s *scanner) object(scratch []byte, member func(key []byte) error) ([]byte, error) {
	if s.peek() != '{' {
		return scratch, s.unexpected("an object")
	}
	s.i++
	s.ws()
	if s.peek() == '}' {
		s.i++
		return scratch, nil
	}
	for {
		var err error
		if scratch, err = s.str(scratch[:0]); err != nil {
			return scratch, err
		}
		if err := s.consume(':'); err != nil {
			return scratch, err
		}
		if err := member(scratch); err != nil {
			return scratch, err
		}
		more, err := s.next('}')
		if err != nil || !more {
			return scratch, err
		}
	}
}

// str decodes the string at s.i, appending its characters to dst.
func (s *scanner) str(dst []byte) ([]byte, error) { return s.scanStr(dst, true) }

// scanStr scans the string at s.i, appending its characters to dst when
// keep is set.
func (s *scanner) scanStr(dst []byte, keep bool) ([]byte, error) {
	if s.peek() != '"' {
		return dst, s.unexpected("a string")
	}
	s.i++
	for {
		start := s.i
		for s.i < len(s.b) && s.b[s.i] != '"' && s.b[s.i] != '\\' && s.b[s.i] >= 0x20 {
			s.i++
		}
		if keep {
			dst = append(dst, s.b[start:s.i]...)
		}
		if s.i == len(s.b) {
			return dst, s.errAt(s.i, "unterminated string")
		}
		switch c := s.b[s.i]; {
		case c == '"':
			s.i++
			return dst, nil
		case c < 0x20:
			return dst, s.errAt(s.i, "control character %#02x in a string (it must be escaped)", c)
		}
		esc := s.i
		if s.i+1 == len(s.b) {
			return dst, s.errAt(s.i, "unterminated string")
		}
		c := s.b[s.i+1]
		s.i += 2
		switch c {
		case '"', '\\', '/':
		case 'b':
			c = '\b'
		case 'f':
			c = '\f'
		case 'n':
			c = '\n'
		case 'r':
			c = '\r'
		case 't':
			c = '\t'
		case 'u':
			r, ok := s.hex4(s.i)
			if !ok {
				return dst, s.errAt(esc, "invalid escape: \\u needs four hex digits")
			}
			s.i += 4
			if utf16.IsSurrogate(r) {
				lo, ok := rune(0), false
				if r < 0xdc00 && s.i+6 <= len(s.b) && s.b[s.i] == '\\' && s.b[s.i+1] == 'u' {
					lo, ok = s.hex4(s.i + 2)
					ok = ok && lo >= 0xdc00 && lo <= 0xdfff
				}
				if !ok {
					return dst, s.errAt(esc, "unpaired UTF-16 surrogate \\u%04x in a string (names and metadata must be valid Unicode)", r)
				}
				s.i += 6
				r = utf16.DecodeRune(r, lo)
			}
			if keep {
				dst = utf8.AppendRune(dst, r)
			}
			continue
		default:
			return dst, s.errAt(esc, "invalid escape \\%c", c)
		}
		if keep {
			dst = append(dst, c)
		}
	}
}

// hex4 decodes the four hex digits at b[i:].
func (s *scanner) hex4(i int) (rune, bool) {
	if i+4 > len(s.b) {
		return 0, false
	}
	var r rune
	for _, c := range s.b[i : i+4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}

// skip scans over the value at s.i, checking its syntax; depth is the
// nesting of that value.
func (s *scanner) skip(depth int) error {
	if depth > maxDepth {
		return s.errAt(s.i, "values nested deeper than %d", maxDepth)
	}
	switch c := s.peek(); {
	case c == '"':
		_, err := s.scanStr(nil, false)
		return err
	case c == '{':
		_, err := s.object(nil, func([]byte) error { return s.skip(depth + 1) })
		return err
	case c == '[':
		s.i++
		s.ws()
		if s.peek() == ']' {
			s.i++
			return nil
		}
		for {
			if err := s.skip(depth + 1); err != nil {
				return err
			}
			more, err := s.next(']')
			if err != nil || !more {
				return err
			}
		}
	case c == 't':
		return s.literal("true")
	case c == 'f':
		return s.literal("false")
	case c == 'n':
		return s.literal("null")
	case c == '-' || '0' <= c && c <= '9':
		return s.number()
	}
	return s.unexpected("a value")
}

func (s *scanner) literal(word string) error {
	if len(s.b)-s.i < len(word) || string(s.b[s.i:s.i+len(word)]) != word {
		return s.unexpected(word)
	}
	s.i += len(word)
	return nil
}

// number scans a number: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (s *scanner) number() error {
	if s.peek() == '-' {
		s.i++
	}
	switch c := s.peek(); {
	case c == '0':
		s.i++
	case '1' <= c && c <= '9':
		s.digits()
	default:
		return s.unexpected("a digit")
	}
	if s.peek() == '.' {
		s.i++
		if !s.digits() {
			return s.unexpected("a digit")
		}
	}
	if c := s.peek(); c == 'e' || c == 'E' {
		s.i++
		if c := s.peek(); c == '+' || c == '-' {
			s.i++
		}
		if !s.digits() {
			return s.unexpected("a digit")
		}
	}
	return nil
}

// digits skips a run of decimal digits, reporting whether there was one.
func (s *scanner) digits() bool {
	start := s.i
	for s.i < len(s.b) && '0' <= s.b[s.i] && s.b[s.i] <= '9' {
		s.i++
	}
	return s.i > start
}

// uints parses the array of integers in [0, 2^64) at s.i into dst. It
// returns false, with s.i unchanged, for any other value (an array with a
// negative, fractional, exponent or too large element too), so that the
// caller can skip the value and report its text.
func (s *scanner) uints(dst []uint64) ([]uint64, bool) {
	start := s.i
	if s.peek() != '[' {
		return dst, false
	}
	s.i++
	s.ws()
	if s.peek() == ']' {
		s.i++
		return dst, true
	}
	for {
		v, ok := s.uint()
		if !ok {
			s.i = start
			return dst, false
		}
		dst = append(dst, v)
		more, err := s.next(']')
		if err != nil {
			s.i = start
			return dst, false
		}
		if !more {
			return dst, true
		}
	}
}

// uint parses an integer in [0, 2^64) written without sign, fraction or
// exponent.
func (s *scanner) uint() (uint64, bool) {
	start := s.i
	var v uint64
	for s.i < len(s.b) && '0' <= s.b[s.i] && s.b[s.i] <= '9' {
		d := uint64(s.b[s.i] - '0')
		if v > (1<<64-1-d)/10 {
			return 0, false
		}
		v = v*10 + d
		s.i++
	}
	switch {
	case s.i == start, s.b[start] == '0' && s.i-start > 1:
		return 0, false
	}
	switch s.peek() {
	case '.', 'e', 'E':
		return 0, false
	}
	return v, true
}

// rawValue skips the value at s.i and returns its text.
func (s *scanner) rawValue() ([]byte, error) {
	start := s.i
	if err := s.skip(1); err != nil {
		return nil, err
	}
	return s.b[start:s.i], nil
}
