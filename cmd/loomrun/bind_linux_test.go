package main

import (
	"fmt"
	"strings"
	"testing"
)

// TestBindCore checks that under --bind core each local rank runs on its
// own CPUs from its first instruction (the mask loomrun's plan gives it),
// and under --bind none on all of loomrun's; loomrun's internal variable
// never reaches the rank.
func TestBindCore(t *testing.T) {
	allowed, err := allowedCPUs()
	if err != nil {
		t.Fatal(err)
	}
	n := min(2, len(allowed))
	plan, _ := planCPUs(allowed, n)
	for _, bind := range []string{bindCore, bindNone} {
		t.Run(bind, func(t *testing.T) {
			r := launch(t, config{nproc: n, bind: bind}, nil, "affinity")
			if r.code != 0 {
				t.Fatalf("exit %d", r.code)
			}
			for rank := range n {
				want := allowed
				if bind == bindCore {
					want = plan[rank]
				}
				line := fmt.Sprintf("[rank %d] cpus=%s leaked=false\n", rank, formatCPUs(want))
				if !strings.Contains(r.stdout, line) {
					t.Errorf("stdout lacks %q", line)
				}
			}
		})
	}
}
