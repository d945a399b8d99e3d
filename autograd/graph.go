package autograd

// graphState is what one recording scope owns: its recorded nodes, the
// generation that tells its values from those of earlier passes and of
// other scopes, and the arena its saved values and intermediate gradients
// live in (cleared with the scope, so one scope's clearing cannot hand
// out memory another scope's backward still needs).
type graphState struct {
	nodes []*node
	gen   uint64
	arena *arena
	// weights is set from BackwardInput until BackwardWeight: the scope
	// keeps its nodes for the weight half and records nothing meanwhile.
	weights bool
}

// graphs is a tape's bookkeeping of its Graphs.
type graphs struct {
	made int    // Graphs made on the tape
	gens uint64 // the last generation handed out
	cur  *Graph // the Graph whose state is active; nil for the default scope
	def  graphState
}

// Graph is a recording scope of a tape: the ops recorded while Do runs go
// into the Graph rather than into the tape's default scope, and a
// Backward (or BackwardFrom, BackwardInput) run inside Do walks and
// clears only them. Several Graphs on one tape share its leaves
// (parameters) and their gradients, so a pipeline stage keeps the
// forwards of several micro-batches in flight at once, each its own
// Graph, and runs their backwards in any order: the gradients add up in
// the leaves as the backwards run.
//
// A Graph is reusable: its ops are cleared by the backward that walks them
// (or by Reset inside Do), and the next Do records afresh, reusing its
// scratch memory. Like its tape, a Graph is not safe for concurrent use.
// ActivationBytes counts what every scope of the tape holds.
type Graph struct {
	t     *Tape
	state graphState
}

// NewGraph returns a new, empty recording scope of t. It fails with
// ErrInvalid on a tape made WithRecycling (whose op results live until
// the tape's Recycle, which knows only one scope).
func (t *Tape) NewGraph() (*Graph, error) {
	if t == nil {
		return nil, invalidf("NewGraph", "nil tape")
	}
	if t.recycling {
		return nil, invalidf("NewGraph", "the tape recycles its results (WithRecycling), which a second recording scope would outlive")
	}
	t.graphs.made++
	t.graphs.gens++
	return &Graph{t: t, state: graphState{gen: t.graphs.gens, arena: &arena{poison: t.arena.poison}}}, nil
}

// Tape returns the tape g records on.
func (g *Graph) Tape() *Tape {
	if g == nil {
		return nil
	}
	return g.t
}

// Len returns the number of ops g holds (recorded and not yet cleared).
func (g *Graph) Len() int {
	if g == nil {
		return 0
	}
	if g.t.graphs.cur == g {
		return len(g.t.nodes)
	}
	return len(g.state.nodes)
}

// Do runs fn with g as the tape's recording scope and returns fn's error:
// ops fn records go into g, and a Backward inside fn walks g. Do calls
// nest (an inner Do of another Graph suspends g until it returns). It
// fails with ErrInvalid inside a checkpointed function or a backward walk.
func (g *Graph) Do(fn func() error) error {
	if g == nil || g.t == nil || fn == nil {
		return invalidf("Graph.Do", "nil graph or function")
	}
	t := g.t
	if t.graphs.cur == g {
		return fn()
	}
	if len(t.frames) > 0 || t.walk != nil {
		return invalidf("Graph.Do", "cannot change the recording scope inside a checkpointed function or a backward walk")
	}
	restore := t.use(g)
	defer restore()
	return fn()
}

// use makes g (nil: the default scope) the active scope and returns the
// function that restores the previous one.
func (t *Tape) use(g *Graph) func() {
	prev := t.graphs.cur
	if prev == g {
		return func() {}
	}
	t.park(prev)
	t.load(g)
	return func() {
		t.park(g)
		t.load(prev)
	}
}

// park stores the active state back into its owner (g, or the default
// scope for nil).
func (t *Tape) park(g *Graph) {
	if g == nil {
		t.graphs.def = t.graphState
	} else {
		g.state = t.graphState
	}
	t.graphState = graphState{}
}

// load makes g's state (the default scope's for nil) the active one.
func (t *Tape) load(g *Graph) {
	if g == nil {
		t.graphState, t.graphs.def = t.graphs.def, graphState{}
	} else {
		t.graphState, g.state = g.state, graphState{}
	}
	t.graphs.cur = g
}
