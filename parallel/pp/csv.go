package pp

import (
	"fmt"
	"io"

	"github.com/b7ea7098/loom"
)

// ParseAction parses one action in PyTorch's notation ("0F1", "1B0",
// "2I3", "0W1", "1SEND_F2", "0UNSHARD").
func ParseAction(text string) (Action, error) {
	return Action{}, fmt.Errorf("%w: parse: not built yet", loom.ErrUnsupported)
}

// WriteCSV writes s as CSV: one row per rank, one action per cell.
func (s *Schedule) WriteCSV(w io.Writer) error {
	return fmt.Errorf("%w: csv: not built yet", loom.ErrUnsupported)
}

// ReadCSV reads a schedule written by WriteCSV or by hand (one row per
// rank) and returns it through Infer, validated.
func ReadCSV(r io.Reader) (*Schedule, error) {
	return nil, fmt.Errorf("%w: csv: not built yet", loom.ErrUnsupported)
}

// Table returns s as a table of time steps (rows) against ranks
// (columns), PyTorch's format.
func (s *Schedule) Table() string { return "" }
