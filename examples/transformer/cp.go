package main

import (
	"flag"
	"fmt"

	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/cp"
)

// cpFlags are the context-parallel flags: -cp ranks the sequence is
// sharded over (the innermost mesh axis, "cp"), -cp-method the attention
// method over it, -cp-balance the causal load balancing of the shards and
// -cp-flat-fsdp whether -fsdp shards over the flattened fsdp×cp axes.
type cpFlags struct {
	cp       int
	method   string
	balance  bool
	flatFSDP bool
}

// register adds -cp, -cp-method and -cp-balance to fs.
func (c *cpFlags) register(fs *flag.FlagSet) {
	fs.IntVar(&c.cp, "cp", 1, "context-parallel ranks: the sequence of every activation is sharded over them and attention runs by -cp-method")
	fs.StringVar(&c.method, "cp-method", "auto", "with -cp: the attention method: auto (the cost model picks per call), ring, allgather, ulysses (heads/tp divisible by cp) or hybrid (Ulysses within groups of 2, the ring across them; cp even)")
	fs.BoolVar(&c.balance, "cp-balance", true, "with -cp: load-balance the causal work (rank r of k holds sequence chunks r and 2k−1−r of 2k); false shards it in contiguous blocks")
	fs.BoolVar(&c.flatFSDP, "cp-flat-fsdp", true, "with -cp and -fsdp: FSDP shards over the flattened fsdp×cp axes, each rank holding 1/(fsdp·cp) of the parameters (torchtitan's dp_shard_cp); false shards over fsdp alone and sums the gradients over cp")
}

// check reads -cp-method and checks the flags together; the model's
// heads against the method are gpt.Config.CheckLayout's (layoutMethod
// gives it the method, and Hybrid's groups of 2).
func (c cpFlags) check() error {
	if c.cp < 1 {
		return fmt.Errorf("-cp %d; want at least 1", c.cp)
	}
	m, err := cp.ParseMethod(c.method)
	if err != nil {
		return fmt.Errorf("-cp-method: %w", err)
	}
	if c.cp == 1 {
		if m != cp.Auto || !c.balance {
			return fmt.Errorf("-cp-method and -cp-balance apply to context parallelism: set -cp to 2 or more")
		}
	}
	return nil
}

// layoutMethod is -cp-method as gpt.Layout takes it: the method and
// Hybrid's inner (Ulysses) ranks, 2. An unknown name is Auto here; check
// reports it.
func (c cpFlags) layoutMethod() (m cp.Method, inner int) {
	m, err := cp.ParseMethod(c.method)
	switch {
	case err != nil:
		return cp.Auto, 0
	case m == cp.Hybrid:
		return m, 2
	}
	return m, 0
}

// axes is the mesh the ranks build: dp × fsdp × tp, and cp innermost.
// Hybrid splits cp into an outer ring axis "cp" of cp/2 and an inner
// Ulysses axis "cpu" of 2.
func (c cpFlags) axes(dp, fsdp, tp int) (shape []int, names []string) {
	shape, names = []int{dp, fsdp, tp}, []string{"dp", "fsdp", "tp"}
	switch {
	case c.cp > 1 && c.hybrid():
		return append(shape, c.cp/2, 2), append(names, "cp", "cpu")
	case c.cp > 1:
		return append(shape, c.cp), append(names, "cp")
	}
	return shape, names
}

// flat reports whether FSDP over fsdp ranks shards over fsdp×cp.
func (c cpFlags) flat(fsdp int) bool { return c.cp > 1 && fsdp > 1 && c.flatFSDP }

// trainOptions are the trainer's options for the flags, with fsdp
// FSDP ranks.
func (c cpFlags) trainOptions(fsdp int) []gpt.TrainOption {
	if c.cp < 2 {
		return nil
	}
	m, _ := cp.ParseMethod(c.method) // checked by check
	var opts []cp.Option
	if m != cp.Hybrid { // WithUlyssesAxis makes it hybrid
		opts = append(opts, cp.WithMethod(m))
	}
	out := []gpt.TrainOption{gpt.WithContextParallel("cp", opts...)}
	if m == cp.Hybrid {
		out = append(out, gpt.WithUlyssesAxis("cpu"))
	}
	if !c.balance {
		out = append(out, gpt.WithPlainSequenceShards())
	}
	if c.flat(fsdp) {
		out = append(out, gpt.WithShardOverCP())
	}
	return out
}

// layout is the run's context parallelism for the first line, with fsdp
// FSDP ranks ("" for none): how FSDP shards beside it when it does.
func (c cpFlags) layout(fsdp int) string {
	if c.cp < 2 {
		return ""
	}
	s := fmt.Sprintf(" × cp=%d (%s", c.cp, c.method)
	if !c.balance {
		s += ", plain shards"
	}
	switch {
	case c.flat(fsdp):
		s += fmt.Sprintf("; FSDP over fsdp×cp: 1/%d of the parameters per rank", fsdp*c.cp)
	case fsdp > 1:
		s += fmt.Sprintf("; FSDP over fsdp: 1/%d of the parameters per rank, gradients summed over cp", fsdp)
	}
	return s + ")"
}

// cpResult is what -json adds: "cp" and "cp_method" ("" without).
type cpResult struct {
	CP       int    `json:"cp"`
	CPMethod string `json:"cp_method"`
}

// result is the flags' -json fields.
func (c cpFlags) result() cpResult {
	r := cpResult{CP: c.cp}
	if c.cp > 1 {
		r.CPMethod = c.method
	}
	return r
}

// names is the mesh's axis names (see axes).
func (c cpFlags) names(dp, fsdp, tp int) []string {
	_, names := c.axes(dp, fsdp, tp)
	return names
}

// hybrid reports whether -cp-method is hybrid.
func (c cpFlags) hybrid() bool {
	m, _ := c.layoutMethod()
	return m == cp.Hybrid
}
