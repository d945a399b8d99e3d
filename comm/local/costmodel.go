package local

import (
	"bufio"
	"fmt"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/kernel"
)

// MachineModel returns this machine's cost model, as comm.CostModelEnv
// says. With it set to comm.CostModelOff it is comm.BuiltinCostModel:
// nothing is measured, read or written. Otherwise it is the model cached in
// comm.CostModelFile if that was measured on this machine with this
// software (same CPU model, CPU count, OS, architecture, GOMAXPROCS, Go
// version and algorithm set), else a fresh Calibrate, about a second, then
// written to that file unless the measurement was disturbed (Spread above
// comm.NoisySpread). Parameters outside the plausible range
// (comm.CostModel.Plausible) are replaced by the built-in values. A
// process measures once per file: the model describes the hardware, not
// program state. Each call returns a new copy.
func MachineModel() *comm.CostModel { return processModels.get(Calibrate) }

// processModels is the per-process memory of MachineModel.
var processModels = &modelCache{byPath: map[string]*comm.CostModel{}}

// modelCache remembers the model of each cache file, so that the second
// world of a process neither reads the file again nor measures again.
type modelCache struct {
	// mu is held while measuring too: two worlds created at once must not
	// calibrate concurrently, each skewing the other's timings.
	mu     sync.Mutex
	byPath map[string]*comm.CostModel
}

// get returns a copy of the model for the file comm.CostModelFile names,
// calling calibrate only when there is neither a remembered model nor a
// cached one for this machine.
func (c *modelCache) get(calibrate func() *comm.CostModel) *comm.CostModel {
	path, err := comm.CostModelFile()
	if err == nil && path == "" {
		return comm.BuiltinCostModel()
	}
	// With no cache folder (err != nil) the model is measured, remembered
	// under "" and not saved.
	c.mu.Lock()
	defer c.mu.Unlock()
	m, ok := c.byPath[path]
	if !ok {
		m = loadOrCalibrate(path, calibrate)
		c.byPath[path] = m
	}
	cp := *m
	return &cp
}

// loadOrCalibrate reads the model cached at path for this machine, or
// measures one and saves it there; path "" means measure without saving.
// Either way a parameter outside the plausible range (comm.CostModel.Plausible)
// is replaced by the built-in value, and a measurement disturbed by other
// work (Spread above comm.NoisySpread) is used but not saved, so that one
// busy moment does not decide the algorithms of every later process.
func loadOrCalibrate(path string, calibrate func() *comm.CostModel) *comm.CostModel {
	id := machineID()
	if path != "" {
		if m, err := comm.LoadCostModel(path, id); err == nil {
			m, _ = m.Plausible()
			return m
		}
	}
	m := calibrate()
	m.Machine = id
	if !m.Valid() {
		return m // NewWorld reports it
	}
	m, _ = m.Plausible()
	if path != "" && m.Spread <= comm.NoisySpread {
		// Not being able to save (a read-only home, a full disk) costs the
		// next process a second of re-measurement and nothing else, so it
		// is not worth failing the world for.
		_ = comm.SaveCostModel(path, m)
	}
	return m
}

// algorithmSet names the version of the local backend's algorithms and of
// their cost simulation: a model cached by a loom whose algorithms differ
// is measured over. Change it whenever an algorithm, a schedule generator
// or schedule.cost changes.
const algorithmSet = "local-algorithms-4"

// machineID names the hardware a model was measured on, and the software
// that measured it: CPU model, CPU count, GOMAXPROCS, Go version and
// algorithmSet.
func machineID() string {
	cpu := "unknown-cpu"
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		s := bufio.NewScanner(f)
		for s.Scan() {
			if k, v, ok := strings.Cut(s.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				cpu = strings.TrimSpace(v)
				break
			}
		}
		_ = f.Close() // read only: closing loses nothing; no name means unknown-cpu
	}
	return fmt.Sprintf("%s/%s/%s/cpus=%d/procs=%d/%s/%s", runtime.GOOS, runtime.GOARCH, cpu,
		runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version(), algorithmSet)
}

// Calibrate measures α (a handoff between two spinning goroutines); β and
// γ (one core's copy time per byte and float32 reduction time per source
// byte) from memory, with and without streaming stores, and within the
// cache; γ of three- and eight-source reductions from memory; the cost of overwriting data another core has just read (on two
// CPUs it binds to; 0 where it cannot); the aggregate copy bandwidth of
// all cores; and reads the size of the last-level cache. It takes about a second.
//
// Each parameter is timed calibrationSamples times and the fastest sample
// that another confirms is kept (see fastest): other work on the machine
// only ever adds time, so minima, not means, describe the hardware. The
// model's Spread records how much the samples varied.
func Calibrate() *comm.CostModel {
	cores := runtime.GOMAXPROCS(0)
	m := &comm.CostModel{Cores: cores, CacheBytes: lastLevelCache(), Measured: time.Now().UTC()}
	spread := 0.0
	take := func(f func() float64) float64 {
		x, s := fastest(calibrationSamples, f)
		spread = max(spread, s)
		return x
	}
	m.Alpha = take(measureHandoff)
	m.Switch = take(measureSwitch)

	// From memory: three 32 MiB buffers exceed any last-level cache here.
	const big = 32 << 20
	a, b, f := make([]byte, big), make([]byte, big), make([]byte, big)
	for i := range b {
		a[i], b[i] = byte(i), byte(i>>8) // real pages, not the shared zero page
	}
	m.Beta = take(func() float64 { return timeCopy(a, b, 1) })
	m.Gamma = take(func() float64 { return timeReduce(kernel.Reduce, f, 1, a, b) })
	m.GammaStream = take(func() float64 { return timeReduce(kernel.ReduceStream, f, 1, a, b) })
	// Three sources of 16 MiB and eight of 8 MiB: both exceed the cache.
	m.GammaStream3 = take(func() float64 {
		return timeReduce(kernel.ReduceStream, f[:big/2], 1, a[:big/2], a[big/2:], b[:big/2])
	})
	m.GammaStream8 = take(func() float64 {
		const q = big / 4
		return timeReduce(kernel.ReduceStream, f[:q], 1, a[:q], a[q:2*q], a[2*q:3*q], a[3*q:], b[:q], b[q:2*q], b[2*q:3*q], b[3*q:])
	})

	// Within the cache: small buffers, reused.
	const small = 128 << 10
	m.BetaCache = take(func() float64 { return timeCopy(a[:small], b[:small], 64) })
	if cores > 1 {
		m.Invalidate = take(func() float64 { return measureInvalidate(a[:small], b[:small]) })
	}
	m.GammaCache = take(func() float64 { return timeReduce(kernel.Reduce, f[:small], 64, a[:small], b[:small]) })

	// Seconds per byte of all cores copying at once; the bandwidth is its
	// inverse.
	m.Bandwidth = 1 / take(func() float64 {
		var wg sync.WaitGroup
		part := big / cores
		t := time.Now()
		for i := 0; i < cores; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				copy(a[i*part:(i+1)*part], b[i*part:(i+1)*part])
			}(i)
		}
		wg.Wait()
		return time.Since(t).Seconds() / float64(part*cores)
	})
	m.Spread = spread
	return m
}

// calibrationSamples is how many times Calibrate times each parameter.
const calibrationSamples = 7

// fastest calls f, which times something, k times and returns the smallest
// result that another result confirms (lies within confirmFactor of it),
// so that a single sample made too fast by a measuring accident (a clock
// step) is rejected as an outlier; with no confirmed pair, the median. It
// also returns the spread: the median divided by the result (by the
// smallest sample when none was confirmed).
func fastest(k int, f func() float64) (x, spread float64) {
	xs := make([]float64, k)
	for i := range xs {
		xs[i] = f()
	}
	slices.Sort(xs)
	med := xs[k/2]
	x, low := med, xs[0] // with no confirmed pair: the median, spread from the lowest
	for i := 0; i+1 < k; i++ {
		if xs[i] > 0 && xs[i+1] <= xs[i]*confirmFactor {
			x, low = xs[i], xs[i]
			break
		}
	}
	if !(low > 0) || math.IsInf(med, 0) {
		return x, 0
	}
	return x, med / low
}

// confirmFactor is how close two samples must be for the smaller to count
// as confirmed by fastest.
const confirmFactor = 1.25

// timeCopy returns seconds per byte of copying src to dst reps times.
func timeCopy(dst, src []byte, reps int) float64 {
	t := time.Now()
	for range reps {
		copy(dst, src)
	}
	return time.Since(t).Seconds() / float64(reps*len(dst))
}

// timeReduce returns seconds per source byte of a float32 sum of srcs
// into dst, done reps times.
func timeReduce(reduce func(comm.DType, comm.ReduceOp, []byte, ...[]byte) error, dst []byte, reps int, srcs ...[]byte) float64 {
	t := time.Now()
	for range reps {
		if err := reduce(comm.Float32, comm.Sum, dst, srcs...); err != nil {
			// Cannot happen with Calibrate's buffers; a NaN makes the model
			// invalid, which NewWorld reports, rather than a wrong choice.
			return math.NaN()
		}
	}
	return time.Since(t).Seconds() / float64(len(srcs)*reps*len(dst))
}

// lastLevelCache reads the size of the largest CPU cache from sysfs, or
// assumes 32 MiB where it cannot.
func lastLevelCache() int64 {
	const fallback = 32 << 20
	best := int64(0)
	for i := 0; i < 8; i++ {
		data, err := os.ReadFile(fmt.Sprintf("/sys/devices/system/cpu/cpu0/cache/index%d/size", i))
		if err != nil {
			break
		}
		s := strings.TrimSpace(string(data))
		mult := int64(1)
		switch {
		case strings.HasSuffix(s, "K"):
			mult, s = 1<<10, strings.TrimSuffix(s, "K")
		case strings.HasSuffix(s, "M"):
			mult, s = 1<<20, strings.TrimSuffix(s, "M")
		}
		if v, err := strconv.ParseInt(s, 10, 64); err == nil && v*mult > best {
			best = v * mult
		}
	}
	if best == 0 {
		return fallback
	}
	return best
}

// measureInvalidate returns the extra seconds per byte of writing a sum of
// src over dst, with ordinary stores as the reduction kernels use, just
// after another core has read dst, compared with writing it again at once:
// the time to take the lines from that core's cache. (A copy would not
// show it: memmove's string stores write whole lines without reading them
// for ownership.) The two sides run on goroutines bound to two different
// CPUs; where binding is impossible it returns 0, which charges nothing.
func measureInvalidate(dst, src []byte) float64 {
	cpus, err := usableCPUs()
	if err != nil || len(cpus) < 2 {
		return 0
	}
	on := func(cpu int, f func()) bool {
		ok := make(chan bool, 1)
		go func() {
			unbind, err := bindThread([]int{cpu})
			if err != nil {
				ok <- false
				return
			}
			defer unbind()
			f()
			ok <- true
		}()
		return <-ok
	}
	const rounds = 4
	shared, own := time.Duration(math.MaxInt64), time.Duration(math.MaxInt64)
	sink := 0
	for range rounds {
		read := func() {
			for j := 0; j < len(dst); j += 64 {
				sink += int(dst[j])
			}
		}
		write := func() {
			t := time.Now()
			_ = kernel.Reduce(comm.Float32, comm.Sum, dst, src, src)
			shared = min(shared, time.Since(t))
			t = time.Now()
			_ = kernel.Reduce(comm.Float32, comm.Sum, dst, src, src)
			own = min(own, time.Since(t))
		}
		if !on(cpus[1], read) || !on(cpus[0], write) {
			return 0
		}
	}
	_ = sink
	return max(shared-own, 0).Seconds() / float64(len(dst))
}

// measureHandoff is half the round trip of a flag bounced between two
// goroutines, in seconds; with one core it includes the scheduler.
func measureHandoff() float64 {
	const rounds = 2000
	var flag atomic.Int64
	done := make(chan struct{})
	go func() {
		for i := int64(1); i <= rounds; i++ {
			for flag.Load() != 2*i-1 {
				runtime.Gosched()
			}
			flag.Store(2 * i)
		}
		close(done)
	}()
	t := time.Now()
	for i := int64(1); i <= rounds; i++ {
		flag.Store(2*i - 1)
		for flag.Load() != 2*i {
			runtime.Gosched()
		}
	}
	el := time.Since(t)
	<-done
	return el.Seconds() / (2 * rounds)
}

// measureSwitch is half the round trip of a flag bounced between two
// goroutines that share one P and yield to each other, in seconds: the
// handoff cost when ranks outnumber cores. It runs with GOMAXPROCS 1 for a
// millisecond or so, once per machine (the model is cached).
func measureSwitch() float64 {
	prev := runtime.GOMAXPROCS(1)
	defer runtime.GOMAXPROCS(prev)
	return measureHandoff()
}

// choiceKey caches the automatic choice of one call shape.
type choiceKey struct {
	op      comm.Op
	n       int
	root    int
	dtype   comm.DType
	avg     bool
	stream  bool
	inPlace string
}

// choose picks the algorithm with the lowest simulated cost under the
// world's model. Every member computes the same answer: the inputs and the
// model are shared.
func (g *group) choose(pl plan, inPlace []byte, dt comm.DType) comm.Algorithm {
	key := choiceKey{op: pl.op, n: pl.n, root: pl.root, dtype: dt, avg: pl.avg, stream: pl.stream, inPlace: string(inPlace)}
	g.schedMu.Lock()
	a, ok := g.choices[key]
	g.schedMu.Unlock()
	if ok {
		return a
	}
	best := g.chooseBy(g.w.model, pl, inPlace, dt)
	g.schedMu.Lock()
	if len(g.choices) >= maxCachedSchedules {
		clear(g.choices)
	}
	g.choices[key] = best
	g.schedMu.Unlock()
	return best
}

// tieMargin: costs within this fraction of each other count as a tie,
// which the schedule with fewer steps wins. A model prices the work of
// two such schedules alike, but every extra step is a synchronisation
// and, in the hardware, a peer reading data another core has just
// written, which the model does not price.
const tieMargin = 0.02

// chooseBy picks the algorithm with the lowest simulated cost under m,
// ties going to the one with fewer steps.
func (g *group) chooseBy(m *comm.CostModel, pl plan, inPlace []byte, dt comm.DType) comm.Algorithm {
	best, bestCost, bestSteps := comm.Direct, math.Inf(1), 0
	for _, cand := range Algorithms(pl.op) {
		pl.algo = cand
		s, err := g.compiled(pl, inPlace)
		if err != nil {
			continue
		}
		c, n := s.cost(m, dt), s.stepCount()
		if c < bestCost*(1-tieMargin) || (c <= bestCost*(1+tieMargin) && n < bestSteps) {
			best, bestCost, bestSteps = cand, c, n
		}
	}
	return best
}

// stepCount is the number of steps of every member together.
func (s *schedule) stepCount() int {
	n := 0
	for _, st := range s.steps {
		n += len(st)
	}
	return n
}

// gammaScale is the reduction cost of a dtype relative to float32 per byte:
// 16-bit floats are widened and narrowed around every operation.
func gammaScale(dt comm.DType) float64 {
	switch dt {
	case comm.BFloat16, comm.Float16:
		return 4
	case comm.Uint8:
		return 2
	}
	return 1
}

// cost simulates the schedule under model m and returns its time in
// seconds: the longest chain of steps and handoffs, but no less than the
// total work spread over the cores, nor, when the working set exceeds the
// cache, the total memory traffic at the machine's aggregate bandwidth.
func (s *schedule) cost(m *comm.CostModel, dt comm.DType) float64 {
	p := len(s.steps)
	es := float64(dt.Size())
	beta, gamma, gammaStream := m.BetaCache, m.GammaCache, m.GammaCache
	if s.stream {
		beta, gamma, gammaStream = m.Beta, m.Gamma, m.GammaStream
	}
	gamma *= gammaScale(dt)
	gammaStream *= gammaScale(dt)
	// A handoff costs alpha while every rank has a core; with more ranks
	// than cores it is a scheduler switch, which also occupies a core.
	handoff, switches := m.Alpha, 0.0
	if p > m.Cores {
		handoff = m.Switch
	}
	end := make([][]float64, p)
	next := make([]int, p)
	clock := make([]float64, p)
	for r := range clock {
		clock[r] = handoff // arrival
	}
	var work, traffic float64
	for progress := true; progress; {
		progress = false
		for r := 0; r < p; r++ {
			for next[r] < len(s.steps[r]) {
				st := &s.steps[r][next[r]]
				start := clock[r]
				ready := true
				for _, d := range st.deps {
					if d.mark == 0 {
						continue
					}
					if next[d.rank] < d.mark {
						ready = false
						break
					}
					start = math.Max(start, end[d.rank][d.mark-1]+handoff)
					switches++
				}
				if !ready {
					break
				}
				bytes := float64(st.dsts[0].n) * es
				outs := float64(len(st.dsts))
				var dur float64
				switch st.kind {
				case stepCopy:
					dur = outs * bytes * beta
					traffic += outs * bytes
				case stepReduce:
					g := gamma
					if s.stream && bytes >= kernel.StreamBytes && (dt == comm.Float32 || dt == comm.Float64) {
						g = gammaStream
					}
					if s.stream {
						g *= m.FanIn(len(st.srcs))
					}
					// Extra destinations are copies of a block still in L1.
					dur = float64(len(st.srcs))*bytes*g + (outs-1)*bytes*beta
					traffic += (float64(len(st.srcs)) + outs) / 2 * bytes
				case stepScale:
					dur = bytes * gamma
					traffic += bytes
				}
				if !s.stream {
					// Overwriting lines a peer holds takes them from its
					// cache first; from memory they have long left it.
					dur += float64(st.contended) * bytes * m.Invalidate
				}
				work += dur
				clock[r] = start + dur
				end[r] = append(end[r], clock[r])
				next[r]++
				progress = true
			}
		}
	}
	span := 0.0
	for _, c := range clock {
		span = math.Max(span, c)
	}
	span += handoff // departure
	cores := float64(min(p, m.Cores))
	if p > m.Cores {
		work += (switches + 2*float64(p)) * m.Switch // every wait, arrival and departure
	}
	t := math.Max(span, work/cores)
	if s.stream { // from memory, all ranks share the memory bandwidth
		t = math.Max(t, traffic/m.Bandwidth)
	}
	return t
}
