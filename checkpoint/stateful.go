package checkpoint

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/placement"
)

// Stateful is a part of a training job whose state a checkpoint holds: a
// model, an optimizer (optim.AdamW, optim.SGD), a data sampler
// (train.Sampler), a trainer (train.Trainer's step, which places a
// learning-rate schedule), a model's trainer (gpt.Trainer, moegpt.Trainer:
// all of these at once), or a user's own.
type Stateful interface {
	// StateDict returns the part's state with every name under prefix:
	// its tensors, handles on the live tensors (not copies; their specs
	// say where each shard lies), which a load fills in place, and its
	// entries, of State.Entries's types. State that does not exist yet
	// but that a load must fill (an optimizer's moments before its first
	// step) is made by StateDict.
	StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error)
	// LoadStateDict sets the part's state from entries (every entry of
	// the loaded checkpoint, by full name) after its tensors (those
	// StateDict returned) have been filled in place. A missing entry or
	// one of another type is an error.
	LoadStateDict(prefix string, entries map[string]any) error
}

// LoadTargeter is a Stateful whose load fills tensors its StateDict does
// not save: a copy of a tensor that another part or rank saves once. A
// pipeline's tied embedding and LM head are one: the first stage saves
// the embedding, and the last stage's copy of it is filled from that
// tensor on load. LoadJob takes LoadTargets' tensors as the part's
// targets instead of StateDict's; JobState (saving) ignores it.
type LoadTargeter interface {
	Stateful
	// LoadTargets returns the tensors a load fills, under full names (a
	// name may be one that another rank also fills), handles on the live
	// tensors as StateDict's are.
	LoadTargets(prefix string) (map[string]*placement.DTensor, error)
}

// Parts maps prefixes to the parts of a job: part p's names are
// prefix+"."+its own names ("model.h.0.attn.qkv.weight",
// "optim.h.0.attn.qkv.weight.exp_avg"). Prefixes are non-empty and
// contain no ".".
type Parts map[string]Stateful

// StepEntry is the entry under which JobState records the job's step.
const StepEntry = "step"

// JobState builds the State of a whole job: every part's tensors and
// entries under its prefix, the step as the int64 entry "step" (so that
// [LoadJob] returns it) and user entries under "user." (entries["epoch"]
// is "user.epoch"). Every rank calls it with its parts; pass the result
// to Save, or to a Saver. Errors wrap ErrInvalid: a bad prefix, a
// negative step, or two names alike; a part's own error is returned
// wrapped.
func JobState(step int, parts Parts, entries map[string]any) (State, error) {
	return jobState("JobState", step, parts, entries, false)
}

// jobState is JobState; with load, the tensors are the load targets
// (LoadTargeter's where a part is one).
func jobState(op string, step int, parts Parts, entries map[string]any, load bool) (State, error) {
	if step < 0 {
		return State{}, invalidf(op, "step %d is negative", step)
	}
	st := State{Tensors: map[string]*placement.DTensor{}, Entries: map[string]any{StepEntry: int64(step)}}
	for _, prefix := range slices.Sorted(maps.Keys(parts)) {
		ts, es, err := partDict(op, prefix, parts[prefix], load)
		if err != nil {
			return State{}, err
		}
		for n, t := range ts {
			st.Tensors[n] = t
		}
		for n, e := range es {
			if _, dup := st.Entries[n]; dup {
				return State{}, invalidf(op, "part %q: entry %q is named twice", prefix, n)
			}
			st.Entries[n] = e
		}
	}
	for _, n := range slices.Sorted(maps.Keys(entries)) {
		st.Entries["user."+n] = entries[n]
	}
	return st, nil
}

// partDict is one part's StateDict under prefix+".", its names checked;
// with load, a LoadTargeter's tensors are its LoadTargets.
func partDict(op, prefix string, p Stateful, load bool) (map[string]*placement.DTensor, map[string]any, error) {
	if prefix == "" || strings.Contains(prefix, ".") || prefix == "user" || prefix == StepEntry {
		return nil, nil, invalidf(op, "part prefix %q: want a non-empty name without \".\", other than \"user\" and \"step\"", prefix)
	}
	if p == nil {
		return nil, nil, invalidf(op, "part %q is nil", prefix)
	}
	ts, es, err := p.StateDict(prefix + ".")
	if err != nil {
		return nil, nil, wrapf(op, err, "part %q", prefix)
	}
	if lt, ok := p.(LoadTargeter); ok && load {
		if ts, err = lt.LoadTargets(prefix + "."); err != nil {
			return nil, nil, wrapf(op, err, "part %q's load targets", prefix)
		}
	}
	for n := range ts {
		if !strings.HasPrefix(n, prefix+".") {
			return nil, nil, invalidf(op, "part %q returned tensor %q outside its prefix", prefix, n)
		}
	}
	for n := range es {
		if !strings.HasPrefix(n, prefix+".") {
			return nil, nil, invalidf(op, "part %q returned entry %q outside its prefix", prefix, n)
		}
	}
	return ts, es, nil
}

// LoadJob loads the checkpoint in dir (Latest's answer, or a folder Save
// returned) into a job's parts, in place, on whatever mesh, placements,
// world size and device the parts now have: it takes every part's
// StateDict (a LoadTargeter's LoadTargets) as the targets, fills the tensors (LoadInto: each rank reads
// only its blocks' bytes), then calls every part's LoadStateDict with the
// checkpoint's entries. It returns the step JobState recorded and the
// user entries (without their "user." prefix). Every rank calls it with
// its parts; opts are LoadInto's (WithComm).
//
// A checkpoint of another model or job (a missing or extra tensor,
// another shape or dtype, a missing entry of the parts' or one of another
// type, no "step" entry) is refused with ErrInvalid naming the tensor or
// entry before any tensor is written; damage is ErrCorrupt. A part's
// LoadStateDict error (a value it refuses) is returned after the tensors
// were filled: the job must not go on from it.
func LoadJob(ctx context.Context, dir string, parts Parts, opts ...Option) (step int, user map[string]any, err error) {
	const op = "LoadJob"
	cfg, err := newConfig(op, forFill, opts)
	if err != nil {
		return 0, nil, err
	}
	st, err := jobState(op, 0, parts, nil, true)
	if err != nil {
		return 0, nil, err
	}
	targets := make(map[string]*placement.Spec, len(st.Tensors))
	for n, t := range st.Tensors {
		if t == nil {
			return 0, nil, invalidf(op, "tensor %q is nil", n)
		}
		targets[n] = t.Spec()
	}
	// The parts' entries must be there, of their types, before anything
	// is written: their LoadStateDict reads them.
	check := func(got map[string]any) error {
		for _, n := range slices.Sorted(maps.Keys(st.Entries)) {
			v, ok := got[n]
			switch {
			case !ok:
				return invalidf(op, "%s has no entry %q (it has %d): a checkpoint of another job?", dir, n, len(got))
			case fmt.Sprintf("%T", v) != fmt.Sprintf("%T", st.Entries[n]):
				return invalidf(op, "%s: entry %q is %T, the job's is %T", dir, n, v, st.Entries[n])
			}
		}
		return nil
	}
	if err := fill(ctx, op, dir, &st, targets, cfg, check); err != nil {
		return 0, nil, err
	}
	s := st.Entries[StepEntry].(int64) // check saw it
	for _, prefix := range slices.Sorted(maps.Keys(parts)) {
		if err := parts[prefix].LoadStateDict(prefix+".", st.Entries); err != nil {
			return 0, nil, wrapf(op, err, "part %q", prefix)
		}
	}
	user = map[string]any{}
	for n, v := range st.Entries {
		if u, ok := strings.CutPrefix(n, "user."); ok {
			user[u] = v
		}
	}
	return int(s), user, nil
}

// Module returns the state dict of a model's module tree: its parameter
// leaves (parallel.Params: after tensor parallelism or FSDP, the
// resharded leaves, which the checkpoint saves as their shards) under
// their names (autograd.Value.Name, the names Export writes), and the
// state of every module of the tree that is itself Stateful (a
// parallel.Dropout's random state) under its path: prefix+path+".".
// Every parameter must have a name of its own.
func Module(root parallel.Module) Stateful { return module{root} }

type module struct{ root parallel.Module }

// StateDict implements Stateful.
func (m module) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	const op = "Module.StateDict"
	ps, err := parallel.Params(m.root)
	if err != nil {
		return nil, nil, wrapf(op, err, "the module tree")
	}
	ts := make(map[string]*placement.DTensor, len(ps))
	for i, p := range ps {
		n := p.Name()
		if n == "" {
			return nil, nil, invalidf(op, "parameter %d has no name", i)
		}
		if _, dup := ts[prefix+n]; dup {
			return nil, nil, invalidf(op, "two parameters are named %q", n)
		}
		ts[prefix+n] = p.Data()
	}
	es := map[string]any{}
	err = m.stateful(func(path string, s Stateful) error {
		t, e, err := s.StateDict(prefix + path + ".")
		if err != nil {
			return wrapf(op, err, "module %q", path)
		}
		for n, x := range t {
			if _, dup := ts[n]; dup {
				return invalidf(op, "module %q's tensor %q is named like another", path, n)
			}
			ts[n] = x
		}
		for n, v := range e {
			es[n] = v
		}
		return nil
	})
	return ts, es, err
}

// stateful calls fn for every module of the tree, but the root, that is
// Stateful, with its path.
func (m module) stateful(fn func(path string, s Stateful) error) error {
	return parallel.Walk(m.root, func(path string, mod parallel.Module) error {
		if s, ok := mod.(Stateful); ok && path != "" {
			return fn(path, s)
		}
		return nil
	})
}

// LoadStateDict implements Stateful: the parameters were filled in place;
// the Stateful modules take their entries.
func (m module) LoadStateDict(prefix string, entries map[string]any) error {
	return m.stateful(func(path string, s Stateful) error {
		if err := s.LoadStateDict(prefix+path+".", entries); err != nil {
			return wrapf("Module.LoadStateDict", err, "module %q", path)
		}
		return nil
	})
}

// StepOf returns the step of the checkpoint in dir (a folder Latest
// returned), from its manifest, which it checks: ErrNotFound when dir
// holds no complete checkpoint, ErrCorrupt when the manifest is damaged.
func StepOf(dir string) (int, error) {
	m, err := readManifest("StepOf", dir)
	if err != nil {
		return 0, err
	}
	return m.Step, nil
}
