package train

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// progress is the display of WithProgress: a line per report, or one
// line redrawn in place (live) on a terminal.
type progress struct {
	w         io.Writer
	live      bool
	first     int // the step Fit started from
	total     int
	perStep   int // samples or tokens per step
	unit      string
	t0, last  time.Time
	lastStep  int
	lineShown bool // live: a line is drawn and not yet ended
}

// barWidth is the live bar's width in characters.
const barWidth = 24

func newProgress(w io.Writer, live *bool) *progress {
	p := &progress{w: w}
	if live != nil {
		p.live = *live
	} else {
		p.live = isTerminal(w)
	}
	return p
}

// isTerminal reports whether w is a character device (a terminal), where
// a redrawn line reads well; files and pipes get plain lines.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func (p *progress) start(first, total, perStep int, tokens bool) {
	p.first, p.total, p.perStep = first, total, perStep
	p.unit = "samples/s"
	if tokens {
		p.unit = "tokens/s"
	}
	p.t0 = time.Now()
	p.last, p.lastStep = p.t0, first
}

// line formats a report: the throughput is over the steps since the
// previous report, the time left extrapolates the mean step time of this
// Fit.
func (p *progress) line(r StepResult, step int, now time.Time) string {
	rate := 0.0
	if dt := now.Sub(p.last).Seconds(); dt > 0 {
		rate = float64((step-p.lastStep)*p.perStep) / dt
	}
	eta := time.Duration(0)
	if done := step - p.first; done > 0 {
		eta = now.Sub(p.t0) / time.Duration(done) * time.Duration(p.total-step)
	}
	return fmt.Sprintf("step %d/%d  loss %.4f  lr %.3g  %.0f %s  eta %v", step, p.total, r.Loss, r.LR, rate, p.unit, eta.Round(time.Second))
}

func (p *progress) report(r StepResult, step int) {
	now := time.Now()
	s := p.line(r, step, now)
	p.last, p.lastStep = now, step
	if !p.live {
		fmt.Fprintln(p.w, s)
		return
	}
	n := 0
	if p.total > 0 {
		n = barWidth * step / p.total
	}
	// \r returns to the line's start and \x1b[K clears the rest of it.
	fmt.Fprintf(p.w, "\r[%s%s] %s\x1b[K", strings.Repeat("=", n), strings.Repeat(" ", barWidth-n), s)
	p.lineShown = true
}

func (p *progress) eval(e EvalResult) {
	var b strings.Builder
	fmt.Fprintf(&b, "eval at step %d:", e.Step)
	for _, k := range sortedKeys(e.Metrics) {
		fmt.Fprintf(&b, "  %s %.4f", k, e.Metrics[k])
	}
	p.endLine()
	fmt.Fprintln(p.w, b.String())
}

// endLine ends a live line, so that what follows starts on its own line.
func (p *progress) endLine() {
	if p.lineShown {
		fmt.Fprintln(p.w)
		p.lineShown = false
	}
}

func (p *progress) done() { p.endLine() }

// writeJSONLine writes v as one line of JSON.
func writeJSONLine(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}
