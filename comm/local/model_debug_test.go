package local

import (
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/comm"
)

func TestPrintModel(t *testing.T) {
	m := MachineModel()
	t.Logf("%+v", *m)
	for _, p := range []int{2, 4, 8} {
		for _, bytes := range []int{4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20} {
			line := fmt.Sprintf("p=%d %8d:", p, bytes)
			n := bytes / 4
			for _, a := range Algorithms(comm.OpAllReduce) {
				s, err := generate(plan{op: comm.OpAllReduce, algo: a, p: p, n: n, piece: pieceElems(comm.Float32), inPlace: make([]bool, p)})
				if err != nil {
					t.Fatal(err)
				}
				line += fmt.Sprintf(" %s=%.0fus", a, s.cost(m, comm.Float32)*1e6)
			}
			t.Log(line)
		}
	}
}
