package pp

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// ParseAction parses one action in PyTorch's notation:
// [stage][kind][micro-batch], as in "0F1", "1B0", "2I3", "0W1",
// "1SEND_F2", "2RECV_B0"; the per-stage kinds have no micro-batch
// ("0UNSHARD", "1RESHARD", "0REDUCE_GRAD"). A communication action's Peer
// is set to its neighbour stage. Text that does not parse is ErrInvalid.
func ParseAction(text string) (Action, error) {
	a, why := parseAction(text)
	if why != "" {
		return Action{}, fmt.Errorf("%w: %s", ErrInvalid, why)
	}
	return a, nil
}

// parseAction is ParseAction with the reason text does not parse ("" when
// it does), for callers that put their own context before it.
func parseAction(text string) (Action, string) {
	t := strings.TrimSpace(text)
	i := 0
	for i < len(t) && t[i] >= '0' && t[i] <= '9' {
		i++
	}
	j := len(t)
	for j > i && t[j-1] >= '0' && t[j-1] <= '9' {
		j--
	}
	bad := func(why string) (Action, string) {
		return Action{}, fmt.Sprintf("action %q: %s (want [stage][kind][micro-batch], e.g. 2F0, 1SEND_B3, 0UNSHARD)", text, why)
	}
	if i == 0 {
		return bad("no stage")
	}
	stage, err := strconv.Atoi(t[:i])
	if err != nil {
		return bad("stage out of range")
	}
	var kind Kind
	for k := F; k <= ReduceGrad; k++ {
		if kindNames[k] == t[i:j] {
			kind = k
		}
	}
	if kind == 0 {
		return bad("unknown kind " + strconv.Quote(t[i:j]))
	}
	a := Action{Stage: stage, Kind: kind, MicroBatch: NoMicroBatch}
	switch {
	case kind.PerStage() && j < len(t):
		return bad(kind.String() + " takes no micro-batch")
	case !kind.PerStage() && j == len(t):
		return bad("no micro-batch")
	case !kind.PerStage():
		if a.MicroBatch, err = strconv.Atoi(t[j:]); err != nil {
			return bad("micro-batch out of range")
		}
	}
	a.Peer = peerOf(stage, kind)
	return a, ""
}

// WriteCSV writes s as CSV in PyTorch's layout: one row per rank, in rank
// order, one action per cell in the rank's order (no header; rows are as
// long as their lists).
func (s *Schedule) WriteCSV(w io.Writer) error {
	if s == nil {
		return fmt.Errorf("%w: write csv: nil schedule", ErrInvalid)
	}
	cw := csv.NewWriter(w)
	for _, acts := range s.Actions {
		row := make([]string, len(acts))
		for i, a := range acts {
			row[i] = a.String()
		}
		if err := cw.Write(row); err != nil {
			return fmt.Errorf("pp: write csv: %w", err)
		}
	}
	cw.Flush()
	if err := cw.Error(); err != nil {
		return fmt.Errorf("pp: write csv: %w", err)
	}
	return nil
}

// ReadCSV reads a schedule in WriteCSV's layout, written by WriteCSV or
// by hand (empty cells, as PyTorch writes for idle steps, are skipped),
// and returns it through Infer with the given name, validated. A cell
// that does not parse is ErrInvalid naming its row (rank) and column.
func ReadCSV(r io.Reader, name string) (*Schedule, error) {
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = -1
	cr.Comment = '#'
	var actions [][]Action
	for {
		row, err := cr.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: read csv: %v", ErrInvalid, err)
		}
		rank := len(actions)
		acts := make([]Action, 0, len(row))
		for col, cell := range row {
			if strings.TrimSpace(cell) == "" {
				continue
			}
			a, why := parseAction(cell)
			if why != "" {
				return nil, fmt.Errorf("%w: csv row %d (rank %d) column %d: %s", ErrInvalid, rank+1, rank, col+1, why)
			}
			acts = append(acts, a)
		}
		actions = append(actions, acts)
	}
	return Infer(name, actions)
}

// Table returns s as a table of time steps (rows, "Step 00", …) against
// ranks (columns, "Rank 0", …), PyTorch's format. For a compute-only
// schedule each compute action takes one step and sits at the step a
// simulation with all compute costs 1 starts it, so an empty cell is a
// rank waiting (the bubble); for a lowered schedule, or one that does not
// validate, step i is each rank's i-th action.
func (s *Schedule) Table() string {
	if s == nil {
		return ""
	}
	cells := make([][]string, len(s.Actions)) // [rank][step]
	steps := 0
	var sim *Simulation
	if !s.Lowered() {
		if g, err := s.check(); err == nil {
			sim, _ = g.run(Costs{F: 1, B: 1, I: 1, W: 1})
		}
	}
	for r, acts := range s.Actions {
		for i, a := range acts {
			t := i
			if sim != nil {
				t = int(sim.Start[r][i])
			}
			for len(cells[r]) <= t {
				cells[r] = append(cells[r], "")
			}
			cells[r][t] = a.String()
		}
		steps = max(steps, len(cells[r]))
	}
	if steps == 0 {
		steps = 1
	}
	digits := len(strconv.Itoa(steps - 1))
	label := func(i int) string { return fmt.Sprintf("Step %0*d", digits, i) }
	width := make([]int, len(cells))
	for r := range cells {
		width[r] = len("Rank " + strconv.Itoa(r))
		for _, c := range cells[r] {
			width[r] = max(width[r], len(c))
		}
	}
	var b strings.Builder
	head := strings.Repeat(" ", len(label(0))+1)
	for r := range cells {
		head += fmt.Sprintf(" %-*s", width[r], "Rank "+strconv.Itoa(r))
	}
	b.WriteString(strings.TrimRight(head, " "))
	b.WriteByte('\n')
	for t := range steps {
		row := label(t) + ":"
		for r := range cells {
			c := ""
			if t < len(cells[r]) {
				c = cells[r][t]
			}
			row += fmt.Sprintf(" %-*s", width[r], c)
		}
		b.WriteString(strings.TrimRight(row, " "))
		b.WriteByte('\n')
	}
	return b.String()
}
