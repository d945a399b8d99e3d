package main

import (
	"encoding/csv"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// cell is one measured (size, variant) entry of the table.
type cell struct {
	variant     string
	median, min time.Duration
	algbw       float64 // GB/s at the median time
	busbw       float64
	wrong       int64
	checked     bool
}

// row is one size of a table.
type row struct {
	job    *job
	shape  shape
	cells  []cell
	chosen string // the algorithm auto chose, if known
}

// header returns the two column-header lines; inplace adds the in-place
// group.
func header(inplace bool) string {
	groups := 1
	if inplace {
		groups = 2
	}
	var a, b strings.Builder
	fmt.Fprintf(&a, "#%11s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop", "root")
	fmt.Fprintf(&b, "#%11s  %12s  %8s  %6s  %6s", "(B)", "(elements)", "", "", "")
	for range groups {
		fmt.Fprintf(&a, "  %7s  %6s  %6s  %5s %6s", "time", "algbw", "busbw", "%ceil", "#wrong")
		fmt.Fprintf(&b, "  %7s  %6s  %6s  %5s %6s", "(us)", "(GB/s)", "(GB/s)", "", "")
	}
	return strings.TrimRight(a.String(), " ") + "\n" + strings.TrimRight(b.String(), " ") + "\n"
}

// formatTime prints microseconds in seven columns as nccl-tests does.
func formatTime(d time.Duration) string {
	us := float64(d) / float64(time.Microsecond)
	switch {
	case us >= 10000:
		return fmt.Sprintf("%7.0f", us)
	case us >= 100:
		return fmt.Sprintf("%7.1f", us)
	}
	return fmt.Sprintf("%7.2f", us)
}

// format prints the row; ceiling is the copy bandwidth in GB/s (0: unknown).
func (r row) format(ceiling float64) string {
	j := r.job
	redop, root := "none", -1
	if j.op.op.Reduces() {
		redop = j.redop.String()
	}
	if j.op.op.Rooted() {
		root = j.root
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%12d  %12d  %8s  %6s  %6d", r.shape.bytes, r.shape.paramCount, j.dtype, redop, root)
	for _, c := range r.cells {
		pct := "  N/A"
		if ceiling > 0 {
			pct = fmt.Sprintf("%5.1f", 100*c.busbw/ceiling)
		}
		wrong := "N/A"
		if c.checked {
			wrong = strconv.FormatInt(c.wrong, 10)
		}
		fmt.Fprintf(&b, "  %7s  %6.2f  %6.2f  %5s %6s", formatTime(c.median), c.algbw, c.busbw, pct, wrong)
	}
	return b.String() + "\n"
}

// csvHeader is the column list of docs/design.md §8.
var csvHeader = []string{"impl", "op", "variant", "nranks", "bytes", "iters", "time_us", "min_us", "algbw_GBps", "busbw_GBps", "note"}

// csvRecords returns the CSV records of a row, one per cell.
func (r row) csvRecords(backendName string) [][]string {
	j := r.job
	var out [][]string
	for _, c := range r.cells {
		var note []string
		if c.variant == inPlace {
			note = append(note, "inplace")
		}
		if c.checked && c.wrong > 0 {
			note = append(note, fmt.Sprintf("wrong=%d", c.wrong))
		}
		if j.algo == comm.Auto && r.chosen != "" {
			note = append(note, "auto="+r.chosen)
		}
		out = append(out, []string{
			"loom-" + backendName,
			j.op.String(),
			j.algo.String(),
			strconv.Itoa(j.ranks),
			strconv.FormatInt(r.shape.bytes, 10),
			strconv.Itoa(j.iters),
			strconv.FormatFloat(float64(c.median)/float64(time.Microsecond), 'f', 3, 64),
			strconv.FormatFloat(float64(c.min)/float64(time.Microsecond), 'f', 3, 64),
			strconv.FormatFloat(c.algbw, 'f', 4, 64),
			strconv.FormatFloat(c.busbw, 'f', 4, 64),
			strings.Join(note, ";"),
		})
	}
	return out
}

// writeCSV writes the header and records to path atomically: a temporary
// file in the same folder, renamed over path once complete.
func writeCSV(path string, records [][]string) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	// fail abandons the temporary file: err is the failure, and removing
	// the file is only tidying (a leftover is hidden and harmless).
	fail := func(err error) error {
		_ = os.Remove(tmp)
		return err
	}
	if err := writeCSVTo(f, records); err != nil {
		_ = f.Close()
		return fail(err)
	}
	if err := f.Close(); err != nil {
		return fail(err)
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(err)
	}
	return nil
}

func writeCSVTo(w io.Writer, records [][]string) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(csvHeader); err != nil {
		return err
	}
	if err := cw.WriteAll(records); err != nil {
		return err
	}
	return cw.Error()
}

// tableStats accumulates the footer of one table.
type tableStats struct {
	busbwSum float64
	cells    int
	wrong    int64
}

func (t *tableStats) add(r row) {
	for _, c := range r.cells {
		t.busbwSum += c.busbw
		t.cells++
		if c.checked {
			t.wrong += c.wrong
		}
	}
}

// footer returns nccl-tests' footer lines for the table.
func (t *tableStats) footer(checked bool) string {
	var b strings.Builder
	if checked {
		status := "OK"
		if t.wrong > 0 {
			status = "FAILED"
		}
		fmt.Fprintf(&b, "# Out of bounds values : %d %s\n", t.wrong, status)
	}
	avg := 0.0
	if t.cells > 0 {
		avg = t.busbwSum / float64(t.cells)
	}
	fmt.Fprintf(&b, "# Avg bus bandwidth : %g\n", roundSig(avg, 6))
	return b.String()
}

// roundSig rounds x to n significant digits.
func roundSig(x float64, n int) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(x, 'g', n, 64), 64) // FormatFloat's output always parses
	return v
}

// choices summarises which algorithm auto chose over the sizes of a table,
// as "ring (8 B..64M B), ..." ranges of consecutive sizes; "" if unknown.
func choices(rows []row) string {
	var parts []string
	for i := 0; i < len(rows); {
		k := i
		for k+1 < len(rows) && rows[k+1].chosen == rows[i].chosen {
			k++
		}
		if rows[i].chosen != "" {
			lo, hi := formatSize(rows[i].shape.bytes), formatSize(rows[k].shape.bytes)
			if i == k {
				parts = append(parts, fmt.Sprintf("%s (%sB)", rows[i].chosen, lo))
			} else {
				parts = append(parts, fmt.Sprintf("%s (%sB..%sB)", rows[i].chosen, lo, hi))
			}
		}
		i = k + 1
	}
	return strings.Join(parts, ", ")
}
