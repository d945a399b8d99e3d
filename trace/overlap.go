package trace

import (
	"cmp"
	"slices"
	"time"
)

// Window selects a stretch of a timeline, as times since its Epoch: events
// are clipped to [From, To). To <= 0 means no end; the zero Window is the
// whole timeline.
type Window struct {
	From, To time.Duration
}

// OverlapStats is how much of a rank's communication was hidden behind its
// compute in a window.
type OverlapStats struct {
	// Comm is the length of the union of the selected comm events.
	Comm time.Duration
	// Hidden is the part of Comm during which some compute event ran.
	Hidden time.Duration
}

// Exposed returns Comm - Hidden: communication during which the rank did
// no recorded compute.
func (o OverlapStats) Exposed() time.Duration { return o.Comm - o.Hidden }

// Fraction returns Hidden/Comm, the fraction of communication hidden
// behind compute, or 0 when there was no communication.
func (o OverlapStats) Fraction() float64 {
	if o.Comm <= 0 {
		return 0
	}
	return float64(o.Hidden) / float64(o.Comm)
}

// Overlap measures, for rank, the union of its comm-lane events that
// commFilter accepts (all of them when commFilter is nil), clipped to win,
// and how much of it the union of the rank's compute events covers.
// Overlapping and nested spans count once. Wait events are not
// communication here: they measure the caller, not the transfer. Overlap
// reads every event, as Events does: measure after the run, not per step
// of a long one.
//
// On a device (a rank with Streams) the stream lanes replace the host
// lanes they time: the rank's LaneStreamComm events, where it has any,
// are its communication, and its LaneStreamCompute events, where it has
// any, its compute (the host lanes then say when work was queued, not
// when it ran). A rank whose collectives run on the host (not a
// device.StreamComm) keeps its LaneComm events against its stream
// compute.
func (tl *Timeline) Overlap(rank int, win Window, commFilter func(Event) bool) OverlapStats {
	var comm, streamComm, comp, streamComp []interval
	onStream := false // the rank has stream comm events, accepted or not
	for _, e := range tl.Events() {
		if e.Rank != rank {
			continue
		}
		iv := interval{e.Start, e.End}
		switch e.Lane {
		case LaneComm, LaneStreamComm:
			onStream = onStream || e.Lane == LaneStreamComm
			if commFilter == nil || commFilter(e) {
				if e.Lane == LaneComm {
					comm = append(comm, iv)
				} else {
					streamComm = append(streamComm, iv)
				}
			}
		case LaneCompute:
			comp = append(comp, iv)
		case LaneStreamCompute:
			streamComp = append(streamComp, iv)
		}
	}
	if onStream {
		comm = streamComm
	}
	if len(streamComp) > 0 {
		comp = streamComp
	}
	return overlap(comm, comp, win)
}

// interval is the half-open span [lo, hi).
type interval struct {
	lo, hi time.Duration
}

// overlap returns the measure of the union of comm clipped to win, and of
// its intersection with the union of compute.
func overlap(commIv, compIv []interval, win Window) OverlapStats {
	c := union(clip(commIv, win))
	k := union(clip(compIv, win))
	return OverlapStats{Comm: measure(c), Hidden: measure(intersect(c, k))}
}

// clip cuts every interval to win and drops the empty ones.
func clip(iv []interval, win Window) []interval {
	out := make([]interval, 0, len(iv))
	for _, v := range iv {
		lo, hi := max(v.lo, win.From), v.hi
		if win.To > 0 {
			hi = min(hi, win.To)
		}
		if hi > lo {
			out = append(out, interval{lo, hi})
		}
	}
	return out
}

// union returns the union of iv as sorted, disjoint, non-touching
// intervals. It reorders iv.
func union(iv []interval) []interval {
	slices.SortFunc(iv, func(a, b interval) int { return cmp.Compare(a.lo, b.lo) })
	var out []interval
	for _, v := range iv {
		if v.hi <= v.lo {
			continue
		}
		if n := len(out); n > 0 && v.lo <= out[n-1].hi {
			out[n-1].hi = max(out[n-1].hi, v.hi)
			continue
		}
		out = append(out, v)
	}
	return out
}

// intersect returns the intersection of two sorted disjoint interval lists.
func intersect(a, b []interval) []interval {
	var out []interval
	for i, j := 0, 0; i < len(a) && j < len(b); {
		lo, hi := max(a[i].lo, b[j].lo), min(a[i].hi, b[j].hi)
		if hi > lo {
			out = append(out, interval{lo, hi})
		}
		if a[i].hi < b[j].hi {
			i++
		} else {
			j++
		}
	}
	return out
}

// measure returns the total length of disjoint intervals.
func measure(iv []interval) time.Duration {
	var d time.Duration
	for _, v := range iv {
		d += v.hi - v.lo
	}
	return d
}
