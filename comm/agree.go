package comm

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"
)

// Agree checks that every rank of c passes the same items in the same
// order: a list that the ranks must agree on before they build anything
// collective from it (DDP's parameter list, a mesh's axes). what names the
// list in the error ("the parameter list"). Agree is a collective: every
// rank of c calls it, under the usual rules.
//
// It all-gathers one 64-bit FNV-1a hash of the encoded list (8 bytes per
// rank), so agreement costs one small all-gather and the hash (about 1.5
// ns per byte of the list): for 100 entries of 40 bytes, about 12 µs at
// p=2 and 30 µs at p=4 on comm/local, medians on a 2-core machine
// (BenchmarkAgree). Only when the hashes
// differ does it gather the lists themselves (their lengths, then the
// lists padded to the longest), so that every rank returns the same
// *DisagreementError, which wraps ErrMismatch. Two different lists with
// the same hash (a chance of 2^-64) pass unnoticed.
//
// A failure of the collectives themselves (timeout, cancellation, abort)
// is returned wrapped. With one rank Agree communicates nothing.
func Agree(ctx context.Context, c Communicator, what string, items []string) error {
	if c == nil {
		return fmt.Errorf("comm: Agree: %w: nil communicator", ErrInvalid)
	}
	p := c.Size()
	if p == 1 {
		return nil
	}
	enc := encodeList(items)
	h := fnv.New64a()
	h.Write(enc) // a hash.Hash's Write never returns an error
	mine := []int64{int64(h.Sum64())}
	hashes := make([]int64, p)
	if err := AllGather(ctx, c, Host(mine), Host(hashes)); err != nil {
		return fmt.Errorf("comm: Agree on %s: exchanging fingerprints: %w", what, err)
	}
	if !slices.ContainsFunc(hashes, func(x int64) bool { return x != hashes[0] }) {
		return nil
	}
	// The lists differ: every rank gathers all of them, so that each
	// builds the same error. Only the failing path pays for this.
	lens := make([]int64, p)
	if err := AllGather(ctx, c, Host([]int64{int64(len(enc))}), Host(lens)); err != nil {
		return fmt.Errorf("comm: Agree on %s: exchanging list lengths: %w", what, err)
	}
	width := int(slices.Max(lens))
	send := make([]uint8, width)
	copy(send, enc)
	all := make([]uint8, p*width)
	if err := AllGather(ctx, c, Host(send), Host(all)); err != nil {
		return fmt.Errorf("comm: Agree on %s: exchanging lists: %w", what, err)
	}
	e := &DisagreementError{What: what, Lists: make([][]string, p)}
	for r := range p {
		if lens[r] < 0 { // only a peer that is not this code sends one
			return fmt.Errorf("comm: Agree on %s: %w: rank %d sent a list of %d bytes", what, ErrMismatch, r, lens[r])
		}
		l, err := decodeList(all[r*width : r*width+int(lens[r])])
		if err != nil {
			return fmt.Errorf("comm: Agree on %s: %w: rank %d's list does not decode: %w", what, ErrMismatch, r, err)
		}
		e.Lists[r] = l
	}
	return e
}

// encodeList encodes items as a uvarint count followed by each item's
// uvarint length and bytes, so that no two lists share an encoding.
func encodeList(items []string) []byte {
	n := binary.MaxVarintLen64
	for _, s := range items {
		n += binary.MaxVarintLen64 + len(s)
	}
	b := make([]byte, 0, n)
	b = binary.AppendUvarint(b, uint64(len(items)))
	for _, s := range items {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	return b
}

// decodeList inverts encodeList.
func decodeList(b []byte) ([]string, error) {
	n, k := binary.Uvarint(b)
	if k <= 0 || n > uint64(len(b)) {
		return nil, fmt.Errorf("bad count")
	}
	b = b[k:]
	out := make([]string, 0, n)
	for range n {
		l, k := binary.Uvarint(b)
		if k <= 0 || l > uint64(len(b)-k) {
			return nil, fmt.Errorf("bad entry %d", len(out))
		}
		out = append(out, string(b[k:k+int(l)]))
		b = b[k+int(l):]
	}
	if len(b) != 0 {
		return nil, fmt.Errorf("%d trailing bytes", len(b))
	}
	return out, nil
}

// DisagreementError reports that the ranks passed different lists to
// Agree. Lists[r] is rank r's list. The message takes the list most ranks
// passed (ties to the one of the lowest rank) as the reference and, for
// each other list, names the ranks that passed it and its first entry
// that differs from the reference:
//
//	ranks disagree on the parameter list: rank 1 has "b [2] float64" at
//	position 0 where ranks 0, 2 have "w [2 3] float64"
//
// It unwraps to ErrMismatch.
type DisagreementError struct {
	What  string
	Lists [][]string
}

// maxGroupsShown bounds the groups of ranks an error describes in detail.
const maxGroupsShown = 3

// Error implements error.
func (e *DisagreementError) Error() string {
	groups := groupLists(e.Lists)
	if len(groups) < 2 {
		return fmt.Sprintf("ranks disagree on %s", e.What)
	}
	ref := 0
	for i, g := range groups {
		if len(g) > len(groups[ref]) {
			ref = i
		}
	}
	want := e.Lists[groups[ref][0]]
	var b strings.Builder
	fmt.Fprintf(&b, "ranks disagree on %s: ", e.What)
	shown := 0
	var rest []int
	for i, g := range groups {
		switch {
		case i == ref:
			continue
		case shown == maxGroupsShown:
			rest = append(rest, g...)
			continue
		case shown > 0:
			b.WriteString("; ")
		}
		shown++
		got := e.Lists[g[0]]
		pos := 0
		for pos < len(got) && pos < len(want) && got[pos] == want[pos] {
			pos++
		}
		fmt.Fprintf(&b, "%s %s %s at position %d where %s %s %s",
			rankList(g), verb(g), entryAt(got, pos), pos, rankList(groups[ref]), verb(groups[ref]), entryAt(want, pos))
		if len(got) != len(want) {
			noun := "entries"
			if len(got) == 1 {
				noun = "entry"
			}
			fmt.Fprintf(&b, " (%d %s against %d)", len(got), noun, len(want))
		}
	}
	if rest != nil {
		slices.Sort(rest)
		fmt.Fprintf(&b, "; %s also differ", rankList(rest))
	}
	return b.String()
}

// Unwrap returns ErrMismatch.
func (e *DisagreementError) Unwrap() error { return ErrMismatch }

// groupLists groups the ranks by equal lists, each group in rank order and
// the groups in order of their lowest rank.
func groupLists(lists [][]string) [][]int {
	var groups [][]int
	for r, l := range lists {
		i := slices.IndexFunc(groups, func(g []int) bool { return slices.Equal(lists[g[0]], l) })
		if i < 0 {
			groups = append(groups, []int{r})
		} else {
			groups[i] = append(groups[i], r)
		}
	}
	return groups
}

// entryAt quotes l[pos], or says there is none.
func entryAt(l []string, pos int) string {
	if pos < len(l) {
		return strconv.Quote(l[pos])
	}
	return "nothing"
}

// verb agrees "has" with the number of ranks.
func verb(ranks []int) string {
	if len(ranks) == 1 {
		return "has"
	}
	return "have"
}

// rankList names sorted ranks compactly: "rank 3", "ranks 0, 2",
// "ranks 0-5, 8".
func rankList(ranks []int) string {
	var parts []string
	for i := 0; i < len(ranks); {
		j := i
		for j+1 < len(ranks) && ranks[j+1] == ranks[j]+1 {
			j++
		}
		switch {
		case j-i >= 2:
			parts = append(parts, fmt.Sprintf("%d-%d", ranks[i], ranks[j]))
		case j > i:
			parts = append(parts, strconv.Itoa(ranks[i]), strconv.Itoa(ranks[j]))
		default:
			parts = append(parts, strconv.Itoa(ranks[i]))
		}
		i = j + 1
	}
	if len(ranks) == 1 {
		return "rank " + parts[0]
	}
	return "ranks " + strings.Join(parts, ", ")
}
