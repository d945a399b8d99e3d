package rendezvous

import (
	"context"
	"fmt"
	"math"
	"strconv"
)

// waitEntry is the channel closed when a missing key is set, shared by
// every request waiting for that key; refs counts them so abandoned entries
// are removed.
type waitEntry struct {
	ch   chan struct{}
	refs int
}

// store is the server's map with blocking reads. All fields are guarded by
// mu (held by the Server).
type store struct {
	data  map[string][]byte
	waits map[string]*waitEntry
}

func newStore() *store {
	return &store{data: make(map[string][]byte), waits: make(map[string]*waitEntry)}
}

// notify wakes the waiters of key. Call with the lock held.
func (s *store) notify(key string) {
	if w := s.waits[key]; w != nil {
		close(w.ch)
		delete(s.waits, key)
	}
}

// set stores value under key. Call with the lock held.
func (s *store) set(key string, value []byte) {
	s.data[key] = value
	s.notify(key)
}

// add adds delta to the decimal counter at key (0 when missing) and
// returns the new value. Call with the lock held.
func (s *store) add(key string, delta int64) (int64, error) {
	var cur int64
	if v, ok := s.data[key]; ok {
		n, err := strconv.ParseInt(string(v), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("value of %q is not a decimal integer", key)
		}
		cur = n
	}
	if (delta > 0 && cur > math.MaxInt64-delta) || (delta < 0 && cur < math.MinInt64-delta) {
		return 0, fmt.Errorf("counter %q overflows: %d + %d", key, cur, delta)
	}
	cur += delta
	s.set(key, strconv.AppendInt(nil, cur, 10))
	return cur, nil
}

// del removes key and reports whether it existed. Call with the lock held.
func (s *store) del(key string) bool {
	_, ok := s.data[key]
	delete(s.data, key)
	return ok
}

// missing returns the first of keys that is not present.
func (s *store) missing(keys []string) (string, bool) {
	for _, k := range keys {
		if _, ok := s.data[k]; !ok {
			return k, true
		}
	}
	return "", false
}

// waitFor blocks until every key is present at once, then returns the value
// of keys[0]. lock and unlock guard the store.
func (s *store) waitFor(ctx context.Context, lock, unlock func(), keys []string) ([]byte, error) {
	for {
		lock()
		k, miss := s.missing(keys)
		if !miss {
			var v []byte
			if len(keys) > 0 {
				v = s.data[keys[0]]
			}
			unlock()
			return v, nil
		}
		w := s.waits[k]
		if w == nil {
			w = &waitEntry{ch: make(chan struct{})}
			s.waits[k] = w
		}
		w.refs++
		unlock()
		select {
		case <-w.ch:
			// notify removed the entry; look again.
		case <-ctx.Done():
			lock()
			if s.waits[k] == w {
				w.refs--
				if w.refs == 0 {
					delete(s.waits, k)
				}
			}
			unlock()
			return nil, ctx.Err()
		}
	}
}
