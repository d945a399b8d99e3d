package pp

import (
	"fmt"
	"strconv"

	"github.com/b7ea7098/loom/internal/numcheck"
)

// Kind is what an Action does.
type Kind uint8

// The kinds of action. The compute kinds (F, I, W, B) and the
// communication kinds (SendF, RecvF, SendB, RecvB) concern one
// micro-batch on one stage; Unshard, Reshard and ReduceGrad concern a
// whole stage and carry NoMicroBatch.
const (
	// F is the forward of a micro-batch on a stage; the stage then holds
	// the micro-batch's activations until its backward (B, or I and W).
	F Kind = iota + 1
	// I is the backward for inputs: the gradient with respect to the
	// stage's input, which the previous stage waits for. It frees the
	// activations only W does not need.
	I
	// W is the backward for weights: the parameters' gradients of a
	// micro-batch whose I has run. Zero-bubble schedules delay it to fill
	// bubbles.
	W
	// B is the full backward (I and W together).
	B
	// SendF sends a micro-batch's activations (the output of F) to the
	// next stage's rank.
	SendF
	// RecvF receives a micro-batch's activations from the previous stage's
	// rank; the stage's F needs it.
	RecvF
	// SendB sends the gradient with respect to a micro-batch's input (the
	// output of B or I) to the previous stage's rank.
	SendB
	// RecvB receives the gradient with respect to a micro-batch's output
	// from the next stage's rank; the stage's B or I needs it.
	RecvB
	// Unshard all-gathers an FSDP stage's parameters before its first
	// compute action of the step.
	Unshard
	// Reshard frees an FSDP stage's gathered parameters after its last
	// compute action of the step.
	Reshard
	// ReduceGrad reduces a stage's gradients across data-parallel ranks
	// once per step, after the stage's last backward (B or W).
	ReduceGrad
)

// kindNames are the kinds' spellings in tables and CSV, PyTorch's.
var kindNames = [...]string{
	F: "F", I: "I", W: "W", B: "B",
	SendF: "SEND_F", RecvF: "RECV_F", SendB: "SEND_B", RecvB: "RECV_B",
	Unshard: "UNSHARD", Reshard: "RESHARD", ReduceGrad: "REDUCE_GRAD",
}

// String returns the kind as tables and CSV spell it: "F", "I", "W", "B",
// "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD",
// "REDUCE_GRAD".
func (k Kind) String() string {
	if int(k) < len(kindNames) && kindNames[k] != "" {
		return kindNames[k]
	}
	return "Kind(" + strconv.Itoa(int(k)) + ")"
}

// Compute reports whether k is F, I, W or B.
func (k Kind) Compute() bool { return k >= F && k <= B }

// Comm reports whether k is SendF, RecvF, SendB or RecvB.
func (k Kind) Comm() bool { return k >= SendF && k <= RecvB }

// PerStage reports whether k concerns a whole stage (Unshard, Reshard,
// ReduceGrad) rather than one micro-batch.
func (k Kind) PerStage() bool { return k >= Unshard && k <= ReduceGrad }

// NoMicroBatch is the MicroBatch of the per-stage actions (Unshard,
// Reshard, ReduceGrad).
const NoMicroBatch = -1

// Action is one step of one rank's list: Kind on Stage for MicroBatch.
// Stages are numbered 0 … Stages()-1 along the model, micro-batches
// 0 … MicroBatches-1.
type Action struct {
	// Stage is the stage the action runs on (for communication, the
	// stage on this rank's side).
	Stage int
	// Kind is what the action does.
	Kind Kind
	// MicroBatch is the micro-batch; NoMicroBatch for Unshard, Reshard
	// and ReduceGrad.
	MicroBatch int
	// Peer is, for SendF, RecvF, SendB and RecvB, the stage on the other
	// end (Stage+1 for SendF and RecvB, Stage-1 for RecvF and SendB);
	// 0 for other kinds. Schedule.RankOf(Peer) is the rank to talk to.
	Peer int
}

// String returns the action in PyTorch's notation: stage, kind,
// micro-batch, as in "0F1", "1B0", "2I3", "0W1", "1SEND_F2", "0UNSHARD".
func (a Action) String() string {
	s := strconv.Itoa(a.Stage) + a.Kind.String()
	if !a.Kind.PerStage() {
		s += strconv.Itoa(a.MicroBatch)
	}
	return s
}

// peerOf returns the stage on the other end of a communication kind.
func peerOf(stage int, k Kind) int {
	switch k {
	case SendF, RecvB:
		return stage + 1
	case RecvF, SendB:
		return stage - 1
	}
	return 0
}

// Comm returns the communication action of kind k (SendF, RecvF, SendB
// or RecvB) on stage for micro-batch mb, with its Peer set.
func Comm(stage int, k Kind, mb int) Action {
	return Action{Stage: stage, Kind: k, MicroBatch: mb, Peer: peerOf(stage, k)}
}

// Placement says which rank holds which stage.
type Placement uint8

const (
	// Loop places stage s on rank s mod Ranks: with V stages per rank,
	// rank r holds r, r+Ranks, r+2·Ranks, … (the interleaved schedule's
	// layout).
	Loop Placement = iota
	// VShape places the stages down the ranks and back: rank r holds
	// r, 2·Ranks−1−r, 2·Ranks+r, …, so the first and last stages are on
	// rank 0 and the turn of the V (stages Ranks−1 and Ranks) stays on
	// the last rank (ZBV's and DualPipeV's layout).
	VShape
)

// String returns "loop" or "v".
func (p Placement) String() string {
	switch p {
	case Loop:
		return "loop"
	case VShape:
		return "v"
	}
	return "Placement(" + strconv.Itoa(int(p)) + ")"
}

// Schedule is a pipeline schedule for one training step: for each rank of
// the pipeline axis, the ordered list of its actions. Builders and CSV
// give compute-only schedules (F, I, W, B); Lower adds the communication.
type Schedule struct {
	// Name says which builder made the schedule ("gpipe", "1f1b",
	// "interleaved", "zb1", "zbv"), or "custom".
	Name string
	// Ranks is the number of ranks of the pipeline axis (pp).
	Ranks int
	// StagesPerRank is the number of stages each rank holds (V); the
	// model has Ranks·StagesPerRank stages.
	StagesPerRank int
	// MicroBatches is the number of micro-batches per step (M).
	MicroBatches int
	// Placement says which rank holds which stage.
	Placement Placement
	// Actions[r] is rank r's list, in the order the rank runs it.
	Actions [][]Action
}

// Stages returns the number of stages, Ranks·StagesPerRank (0 for a nil
// schedule).
func (s *Schedule) Stages() int {
	if s == nil {
		return 0
	}
	return s.Ranks * s.StagesPerRank
}

// RankOf returns the rank that holds stage, or -1 for a stage outside
// [0, Stages()).
func (s *Schedule) RankOf(stage int) int {
	if stage < 0 || stage >= s.Stages() {
		return -1
	}
	return rankOf(s.Placement, s.Ranks, stage)
}

func rankOf(p Placement, ranks, stage int) int {
	chunk, j := stage/ranks, stage%ranks
	if p == VShape && chunk%2 == 1 {
		return ranks - 1 - j
	}
	return j
}

// StagesOf returns the stages rank holds, in increasing order.
func (s *Schedule) StagesOf(rank int) []int {
	var out []int
	for st := 0; st < s.Stages(); st++ {
		if s.RankOf(st) == rank {
			out = append(out, st)
		}
	}
	return out
}

// Lowered reports whether the schedule holds communication or per-stage
// actions (it came from Lower or from a list that has them).
func (s *Schedule) Lowered() bool {
	if s == nil {
		return false
	}
	for _, acts := range s.Actions {
		for _, a := range acts {
			if !a.Kind.Compute() {
				return true
			}
		}
	}
	return false
}

// newSchedule checks the counts and returns an empty schedule.
func newSchedule(name string, ranks, microBatches, stagesPerRank int, p Placement) (*Schedule, error) {
	if err := numcheck.Count(ErrInvalid, name+": ranks", ranks); err != nil {
		return nil, err
	}
	if err := numcheck.Count(ErrInvalid, name+": micro-batches", microBatches); err != nil {
		return nil, err
	}
	if err := numcheck.Count(ErrInvalid, name+": stages per rank", stagesPerRank); err != nil {
		return nil, err
	}
	return &Schedule{
		Name: name, Ranks: ranks, StagesPerRank: stagesPerRank, MicroBatches: microBatches,
		Placement: p, Actions: make([][]Action, ranks),
	}, nil
}

// tooFew is the error for a micro-batch count under a schedule's minimum.
func tooFew(name string, m, min int, why string) error {
	return fmt.Errorf("%w: %s: %d micro-batches: needs at least %d (%s)", ErrInvalid, name, m, min, why)
}

// Build returns the schedule called name for ranks ranks, microBatches
// micro-batches and stagesPerRank stages per rank: "gpipe", "1f1b",
// "interleaved", "zb1" (ZB-H1, also "zbh1"), or "zbv". GPipe, 1F1B and
// ZB-H1 take stagesPerRank 1, ZBV takes 2, interleaved any from 2; 0
// means the schedule's own (2 for interleaved). An unknown name or a
// count a builder refuses is ErrInvalid.
func Build(name string, ranks, microBatches, stagesPerRank int) (*Schedule, error) {
	fixed := func(v int) error {
		if stagesPerRank != 0 && stagesPerRank != v {
			return fmt.Errorf("%w: %s: %d stages per rank: the schedule has %d", ErrInvalid, name, stagesPerRank, v)
		}
		return nil
	}
	switch name {
	case "gpipe":
		if err := fixed(1); err != nil {
			return nil, err
		}
		return GPipe(ranks, microBatches)
	case "1f1b":
		if err := fixed(1); err != nil {
			return nil, err
		}
		return OneFOneB(ranks, microBatches)
	case "interleaved":
		if stagesPerRank == 0 {
			stagesPerRank = 2
		}
		return Interleaved1F1B(ranks, microBatches, stagesPerRank)
	case "zb1", "zbh1":
		if err := fixed(1); err != nil {
			return nil, err
		}
		return ZBH1(ranks, microBatches)
	case "zbv":
		if err := fixed(2); err != nil {
			return nil, err
		}
		return ZBV(ranks, microBatches)
	}
	return nil, fmt.Errorf("%w: schedule %q: want gpipe, 1f1b, interleaved, zb1 or zbv", ErrInvalid, name)
}

// GPipe returns GPipe's schedule: every rank (one stage each) runs the
// forwards of all micro-batches, then their full backwards in the same
// order. Each stage holds all M micro-batches' activations at the peak.
// Any microBatches ≥ 1 is accepted.
func GPipe(ranks, microBatches int) (*Schedule, error) {
	s, err := newSchedule("gpipe", ranks, microBatches, 1, Loop)
	if err != nil {
		return nil, err
	}
	for r := range ranks {
		acts := make([]Action, 0, 2*microBatches)
		for mb := range microBatches {
			acts = append(acts, Action{Stage: r, Kind: F, MicroBatch: mb})
		}
		for mb := range microBatches {
			acts = append(acts, Action{Stage: r, Kind: B, MicroBatch: mb})
		}
		s.Actions[r] = acts
	}
	return s, nil
}

// OneFOneB returns the 1F1B schedule (PipeDream-flush, Megatron's
// non-interleaved one): rank r runs Ranks−1−r warm-up forwards, then
// alternates one forward and one full backward, then runs the remaining
// backwards. A stage holds at most Ranks−r micro-batches' activations.
// It needs microBatches ≥ ranks: with fewer there is no steady phase and
// the schedule is GPipe's.
func OneFOneB(ranks, microBatches int) (*Schedule, error) {
	s, err := newSchedule("1f1b", ranks, microBatches, 1, Loop)
	if err != nil {
		return nil, err
	}
	if microBatches < ranks {
		return nil, tooFew("1f1b", microBatches, ranks, "one per rank")
	}
	for r := range ranks {
		warm := ranks - 1 - r
		acts := make([]Action, 0, 2*microBatches)
		for mb := range warm {
			acts = append(acts, Action{Stage: r, Kind: F, MicroBatch: mb})
		}
		for i := range microBatches - warm {
			acts = append(acts,
				Action{Stage: r, Kind: F, MicroBatch: warm + i},
				Action{Stage: r, Kind: B, MicroBatch: i})
		}
		for mb := microBatches - warm; mb < microBatches; mb++ {
			acts = append(acts, Action{Stage: r, Kind: B, MicroBatch: mb})
		}
		s.Actions[r] = acts
	}
	return s, nil
}
