package commtest_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
)

// brokenEnv names the breakage a child process of TestSuiteCatchesBrokenBackends
// runs the suite against.
const brokenEnv = "COMMTEST_BROKEN"

// breakage is the fake backend with one bug: damage runs on every rank
// after each successful blocking call.
type breakage struct {
	name string
	// op is the suite's subtest the bug shows in: the child runs only it.
	op     string
	damage func(rank int, call *comm.Call)
	// Every failed case must match fails, and each of must must fail.
	fails *regexp.Regexp
	must  []string
}

// brokenLarge is the child's large size: prime, and larger than any small
// size by far.
const brokenLarge = 4099

var breakages = []breakage{
	{
		// One algorithm is wrong: the algorithms share inputs and a
		// reference, which must not hide it or blame the others.
		name: "ring_allreduce_off_by_2^-16",
		op:   "allreduce",
		damage: func(rank int, call *comm.Call) {
			if call.Algorithm == comm.Ring && rank == 1 && call.Recv.Len() > 0 {
				if x, ok := floats32(call.Recv); ok {
					x[len(x)-1] += 0x1p-16 // over 14 times the largest tolerance at p = 3, 2·3·2^-24·3
				}
			}
		},
		fails: regexp.MustCompile(`^allreduce/p=3/n=\d+/float32/(sum|avg|min|max|prod)/ring$`),
		must:  []string{"allreduce/p=3/n=1/float32/sum/ring", "allreduce/p=3/n=4099/float32/sum/ring"},
	},
	{
		// A bug only large buffers hit.
		name: "allgather_large_element",
		op:   "allgather",
		damage: func(rank int, call *comm.Call) {
			if call.Recv.Len() > 3*brokenLarge-10 && rank == 2 {
				b := call.Recv.(*comm.HostBuffer).Bytes()
				b[len(b)/2] ^= 1
			}
		},
		fails: regexp.MustCompile(`^allgather/p=3/n=4099/\w+/\w+$`),
		must:  []string{"allgather/p=3/n=4099/float32/auto", "allgather/p=3/n=4099/float32/ring"},
	},
	{
		// An element left unwritten still holds the suite's garbage.
		name: "reducescatter_float16_unwritten",
		op:   "reducescatter",
		damage: func(rank int, call *comm.Call) {
			if h, ok := call.Recv.(*comm.HostBuffer); ok && h.DType() == comm.Float16 && h.Len() > 0 && rank == 0 {
				h.Bytes()[0], h.Bytes()[1] = 0xa5, 0xa5
			}
		},
		fails: regexp.MustCompile(`^reducescatter/p=3/n=\d+/float16/\w+/\w+$`),
		must:  []string{"reducescatter/p=3/n=1/float16/sum/auto", "reducescatter/p=3/n=2/float16/sum/direct"},
	},
	{
		// Integer sums must wrap: a saturating uint8 sum is wrong.
		name: "uint8_allreduce_saturates",
		op:   "allreduce",
		damage: func(rank int, call *comm.Call) {
			if call.Reduce != comm.Sum || call.Recv.DType() != comm.Uint8 {
				return
			}
			// Recompute the sum saturating: a wrapped sum is below one
			// of the inputs.
			send, recv := call.Send.(*comm.HostBuffer).Uint8s(), call.Recv.(*comm.HostBuffer).Uint8s()
			for i := range recv {
				if recv[i] < send[i] {
					recv[i] = 255
				}
			}
		},
		fails: regexp.MustCompile(`^allreduce/p=3/n=\d+/uint8/sum/\w+$`),
		must:  []string{"allreduce/p=3/n=4099/uint8/sum/auto"},
	},
	{
		// AllToAllV writes past the counted elements.
		name: "alltoallv_writes_slack",
		op:   "alltoallv",
		damage: func(rank int, call *comm.Call) {
			total := 0
			for _, c := range call.RecvCounts {
				total += c
			}
			if b := call.Recv.(*comm.HostBuffer).Bytes(); rank == 0 && total < call.Recv.Len() {
				b[total*call.Recv.DType().Size()] = 0
			}
		},
		fails: regexp.MustCompile(`^alltoallv/p=3/n=\d+/\w+/\w+$`),
		must:  []string{"alltoallv/p=3/n=0/int32/direct", "alltoallv/p=3/n=1/float32/ring"},
	},
}

func floats32(b comm.Buffer) ([]float32, bool) {
	h, ok := b.(*comm.HostBuffer)
	if !ok || h.DType() != comm.Float32 {
		return nil, false
	}
	return h.Float32s(), true
}

// brokenComm is the fake with a breakage.
type brokenComm struct {
	comm.Communicator
	damage func(rank int, call *comm.Call)
}

func (b brokenComm) Do(ctx context.Context, call comm.Call) error {
	if err := b.Communicator.Do(ctx, call); err != nil {
		return err
	}
	b.damage(b.Rank(), &call)
	return nil
}

// TestSuiteCatchesBrokenBackends runs the suite against fakes with one bug
// each, in a child process (the suite reports through its *testing.T), and
// checks that it fails exactly the cases the bug touches: a suite that
// cannot fail would pass any backend.
func TestSuiteCatchesBrokenBackends(t *testing.T) {
	if name := os.Getenv(brokenEnv); name != "" {
		i := slices.IndexFunc(breakages, func(b breakage) bool { return b.name == name })
		if i < 0 {
			t.Fatalf("%s=%q: no such breakage", brokenEnv, name)
		}
		damage := breakages[i].damage
		launch := func(ctx context.Context, p int, fn func(context.Context, comm.Communicator) error) error {
			return fakeLaunch(ctx, p, func(ctx context.Context, c comm.Communicator) error {
				return fn(ctx, brokenComm{c, damage})
			})
		}
		commtest.Run(t, launch, commtest.Config{Ranks: []int{3}, Large: brokenLarge, Algorithms: func(comm.Op) []comm.Algorithm {
			return []comm.Algorithm{comm.Direct, comm.Ring} // the fake ignores them
		}})
		return
	}
	failLine := regexp.MustCompile(`--- FAIL: TestSuiteCatchesBrokenBackends/(\S+)`)
	for _, b := range breakages {
		t.Run(b.name, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestSuiteCatchesBrokenBackends$/^"+b.op+"$", "-test.count=1")
			cmd.Env = append(os.Environ(), brokenEnv+"="+b.name)
			out, err := cmd.CombinedOutput()
			if ee := (*exec.ExitError)(nil); !errors.As(err, &ee) {
				t.Fatalf("the suite passed a broken backend (err %v):\n%s", err, out)
			}
			var failed []string
			for _, m := range failLine.FindAllStringSubmatch(string(out), -1) {
				name := m[1]
				// Parents fail with their children; check the leaves.
				if !slices.ContainsFunc(failLine.FindAllStringSubmatch(string(out), -1), func(o []string) bool {
					return strings.HasPrefix(o[1], name+"/")
				}) {
					failed = append(failed, name)
				}
			}
			for _, f := range failed {
				if !b.fails.MatchString(f) {
					t.Errorf("case %s failed, but the bug cannot touch it", f)
				}
			}
			for _, m := range b.must {
				if !slices.Contains(failed, m) {
					t.Errorf("case %s passed the broken backend", m)
				}
			}
			if t.Failed() {
				t.Logf("the suite's output:\n%s", out)
			}
		})
	}
}
