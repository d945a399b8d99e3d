package comm

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// CostModel is an α-β(-γ) model of moving and reducing data between ranks,
// measured on the machine it runs on. Backends use it to choose algorithms;
// planners use Estimate to price a collective.
type CostModel struct {
	// Alpha is the latency of one synchronisation between two ranks, in
	// seconds.
	Alpha float64 `json:"alpha_s"`
	// Switch is the latency of a synchronisation when the two ranks share
	// a core (more ranks than cores), in seconds: a scheduler handoff.
	Switch float64 `json:"switch_s"`
	// Beta is the time to copy one byte on one rank when the data comes
	// from and goes to memory, in seconds per byte.
	Beta float64 `json:"beta_s_per_byte"`
	// Gamma is the time to fold one byte of a source into a reduction from
	// memory, with ordinary stores, in seconds per byte (float32 sum; other
	// types scale from it).
	Gamma float64 `json:"gamma_s_per_byte"`
	// GammaStream is Gamma with stores that bypass the cache, which large
	// results use.
	GammaStream float64 `json:"gamma_stream_s_per_byte"`
	// GammaStream3 and GammaStream8 are GammaStream for reductions of
	// three and of eight sources, per source byte. Two sources stream
	// through in one pass; more are folded block by block, switching
	// between the source streams, which costs more per byte the more
	// sources there are. Other counts lie on the line through the two
	// (see FanIn). 0 means not measured (every count costs GammaStream).
	GammaStream3 float64 `json:"gamma_stream3_s_per_byte,omitempty"`
	GammaStream8 float64 `json:"gamma_stream8_s_per_byte,omitempty"`
	// BetaCache and GammaCache are Beta and Gamma when the whole working set
	// fits in the last-level cache.
	BetaCache  float64 `json:"beta_cache_s_per_byte"`
	GammaCache float64 `json:"gamma_cache_s_per_byte"`
	// Invalidate is the extra time, in seconds per byte, to write data that
	// another core has read or written since: each store must first take
	// the line from that core's cache. Within the cache this is several
	// times the cost of the write itself; a schedule whose ranks overwrite
	// what a peer read in the previous call (a tree's or chain's partial
	// sums) pays it on every call. 0 means not measured (no charge).
	Invalidate float64 `json:"invalidate_s_per_byte,omitempty"`
	// CacheBytes is the last-level cache size: working sets larger than
	// this run at memory speed.
	CacheBytes int64 `json:"cache_bytes"`
	// Bandwidth is the machine's aggregate memory-copy bandwidth with every
	// core busy, in bytes per second: the ceiling of all ranks together.
	Bandwidth float64 `json:"bandwidth_Bps"`
	// Cores is the number of ranks that can run at once (GOMAXPROCS when
	// measured).
	Cores int `json:"cores"`
	// Machine identifies where and with what it was measured (for
	// comm/local: OS, architecture, CPU model, CPU count, GOMAXPROCS, Go
	// version and the version of loom's algorithm set); a cached model
	// whose Machine differs is ignored and measured over.
	Machine string `json:"machine"`
	// Measured is when it was measured.
	Measured time.Time `json:"measured"`
	// Spread says how disturbed the measurement was: the largest ratio,
	// over the timed parameters, of the median sample to the one kept. A
	// quiet machine gives about 1; other work running during calibration
	// gives more. A model with Spread above NoisySpread is used but not
	// cached, so the next process measures again. 0 means not recorded.
	Spread float64 `json:"spread,omitempty"`
}

// NoisySpread is the CostModel.Spread above which a calibration counts as
// taken on a busy machine.
const NoisySpread = 1.5

// plausibleFactor bounds a measured parameter: one more than this many
// times larger or smaller than the built-in model's is a measuring
// accident (a preempted timer, a busy machine), not hardware.
const plausibleFactor = 10

// Plausible returns a copy of m in which every parameter that lies more
// than a factor of 10 away from BuiltinCostModel's, or that contradicts
// another (a cache slower than memory, all cores together slower than
// one), is replaced by the built-in value, and the JSON names of the
// parameters replaced, in field order (nil when none was). Cores,
// CacheBytes, Machine, Measured and Spread are kept. m must be Valid.
func (m *CostModel) Plausible() (*CostModel, []string) {
	b := BuiltinCostModel()
	out := *m
	var replaced []string
	bound := func(name string, x *float64, builtin float64) {
		if *x < builtin/plausibleFactor || *x > builtin*plausibleFactor {
			*x = builtin
			replaced = append(replaced, name)
		}
	}
	bound("alpha_s", &out.Alpha, b.Alpha)
	bound("switch_s", &out.Switch, b.Switch)
	bound("beta_s_per_byte", &out.Beta, b.Beta)
	bound("gamma_s_per_byte", &out.Gamma, b.Gamma)
	bound("gamma_stream_s_per_byte", &out.GammaStream, b.GammaStream)
	if out.GammaStream3 > 0 || out.GammaStream8 > 0 {
		bound("gamma_stream3_s_per_byte", &out.GammaStream3, b.GammaStream3)
		bound("gamma_stream8_s_per_byte", &out.GammaStream8, b.GammaStream8)
	}
	bound("beta_cache_s_per_byte", &out.BetaCache, b.BetaCache)
	bound("gamma_cache_s_per_byte", &out.GammaCache, b.GammaCache)
	if out.Invalidate > 0 {
		bound("invalidate_s_per_byte", &out.Invalidate, b.Invalidate)
	}
	bound("bandwidth_Bps", &out.Bandwidth, b.Bandwidth)
	// Within the cache data moves at least as fast as from memory; a
	// measurement that says otherwise was disturbed in the cached part.
	if out.BetaCache > out.Beta {
		out.BetaCache = min(b.BetaCache, out.Beta)
		replaced = append(replaced, "beta_cache_s_per_byte")
	}
	if out.GammaCache > out.Gamma {
		out.GammaCache = min(b.GammaCache, out.Gamma)
		replaced = append(replaced, "gamma_cache_s_per_byte")
	}
	// Folding more sources costs no less per byte than folding fewer.
	if out.GammaStream3 > 0 && out.GammaStream3 < out.GammaStream {
		out.GammaStream3 = out.GammaStream
		replaced = append(replaced, "gamma_stream3_s_per_byte")
	}
	if out.GammaStream8 > 0 && out.GammaStream8 < out.GammaStream3 {
		out.GammaStream8 = out.GammaStream3
		replaced = append(replaced, "gamma_stream8_s_per_byte")
	}
	// All cores together copy at least as fast as one.
	if out.Bandwidth*out.Beta < 1 {
		out.Bandwidth = 1 / out.Beta
		replaced = append(replaced, "bandwidth_Bps")
	}
	return &out, replaced
}

// Valid reports whether every parameter is positive and finite (Invalidate
// may also be 0, and GammaStream3 and GammaStream8 both 0: not measured).
func (m *CostModel) Valid() bool {
	ok := func(x float64) bool { return x > 0 && !math.IsInf(x, 0) && !math.IsNaN(x) }
	return m != nil && ok(m.Alpha) && ok(m.Switch) && ok(m.Beta) && ok(m.Gamma) && ok(m.GammaStream) &&
		ok(m.BetaCache) && ok(m.GammaCache) && ok(m.Bandwidth) && m.CacheBytes > 0 && m.Cores > 0 &&
		(m.Invalidate == 0 || ok(m.Invalidate)) &&
		(m.GammaStream3 == 0 && m.GammaStream8 == 0 || ok(m.GammaStream3) && ok(m.GammaStream8))
}

// FanIn is how many times GammaStream a reduction of sources sources costs
// per source byte from memory: 1 for one or two, the line through
// GammaStream3 and GammaStream8 for more (never below 1), and 1 for every
// count when those are not measured.
func (m *CostModel) FanIn(sources int) float64 {
	if sources <= 2 || m.GammaStream3 <= 0 || m.GammaStream8 <= 0 || m.GammaStream <= 0 {
		return 1
	}
	g := m.GammaStream3 + float64(sources-3)*(m.GammaStream8-m.GammaStream3)/5
	return max(g/m.GammaStream, 1)
}

// Estimate prices op over p ranks for a per-rank payload of bytes (the
// "size" of nccl-tests), with the best classic algorithm: ring for large
// payloads, recursive doubling or a tree for small ones.
func (m *CostModel) Estimate(op Op, p int, bytes int64) time.Duration {
	if p <= 1 || bytes < 0 {
		return 0
	}
	n := float64(bytes)
	fp := float64(p)
	lg := math.Ceil(math.Log2(fp))
	var t float64
	switch op {
	case OpAllReduce:
		ring := 2*(fp-1)*m.Alpha + 2*(fp-1)/fp*n*m.Beta + (fp-1)/fp*n*m.Gamma
		rd := lg*m.Alpha + lg*n*(m.Beta+m.Gamma)
		t = math.Min(ring, rd)
	case OpReduceScatter:
		t = (fp-1)*m.Alpha + (fp-1)/fp*n*(m.Beta+m.Gamma)
	case OpAllGather, OpAllToAll, OpAllToAllV:
		t = (fp-1)*m.Alpha + (fp-1)/fp*n*m.Beta
	case OpBroadcast, OpScatter, OpGather:
		t = lg*m.Alpha + n*m.Beta
	case OpReduce:
		t = lg*m.Alpha + n*(m.Beta+m.Gamma)
	case OpSend, OpRecv:
		t = m.Alpha + n*m.Beta
	case OpBarrier, OpSplit:
		t = 2 * lg * m.Alpha
	}
	return time.Duration(t * 1e9)
}

// Settings of the cost-model cache, read by CostModelFile.
const (
	// CostModelEnv names the environment variable that says where the
	// measured cost model is cached: unset, empty or blank means
	// loom/costmodel.json in the user cache folder, CostModelOff (or "none",
	// in any case) means measure nothing and use BuiltinCostModel, and
	// anything else is the path of the cache file (surrounding blanks
	// removed).
	CostModelEnv = "LOOM_COSTMODEL"
	// CostModelOff is the CostModelEnv value that turns measuring off.
	CostModelOff = "off"
)

// BuiltinCostModel returns a fixed model of a typical x86-64 server core
// (about 0.3 µs per handoff, 7 GB/s copies from memory, 30 GB/s within a
// 32 MiB cache, 20 GB/s for all cores together, 0.1 ns per byte to take
// lines from another core's cache, reductions of three and eight sources
// 1.35 and 1.9 times as costly per byte as of two) with Cores set to
// GOMAXPROCS. It is used when measuring is off; its algorithm choices are
// reasonable everywhere and best nowhere. Each call returns a new model.
func BuiltinCostModel() *CostModel {
	return &CostModel{
		Alpha:        3e-7,
		Switch:       5e-7,
		Beta:         1.5e-10,
		Gamma:        1.3e-10,
		GammaStream:  1e-10,
		GammaStream3: 1.35e-10,
		GammaStream8: 1.9e-10,
		BetaCache:    3e-11,
		GammaCache:   2e-11,
		Invalidate:   1e-10,
		CacheBytes:   32 << 20,
		Bandwidth:    2e10,
		Cores:        runtime.GOMAXPROCS(0),
		Machine:      "builtin",
	}
}

// CostModelFile returns the file that caches the measured cost model, as
// CostModelEnv says: its value when that is a path, else
// loom/costmodel.json in the user cache folder (os.UserCacheDir: on Linux
// $XDG_CACHE_HOME or ~/.cache). It returns "" and no error when measuring is
// off (CostModelEnv is CostModelOff or "none"), and an error when the
// variable is unset and there is no user cache folder.
func CostModelFile() (string, error) {
	switch p := strings.TrimSpace(os.Getenv(CostModelEnv)); {
	case strings.EqualFold(p, CostModelOff) || strings.EqualFold(p, "none"):
		return "", nil
	case p != "":
		return p, nil
	}
	dir, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("comm: no cache folder for the cost model (set %s to a file, or to %s): %w", CostModelEnv, CostModelOff, err)
	}
	return filepath.Join(dir, "loom", "costmodel.json"), nil
}

// LoadCostModel reads the model cached in the file at path, measured on
// machine; it returns an error if there is none (wrapping fs.ErrNotExist),
// it is unreadable or invalid, or it belongs to another machine.
func LoadCostModel(path, machine string) (*CostModel, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("comm: LoadCostModel: %w", err)
	}
	var m CostModel
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("comm: LoadCostModel: %s: %w", path, err)
	}
	if !m.Valid() {
		return nil, fmt.Errorf("comm: LoadCostModel: %s holds an invalid model", path)
	}
	if m.Machine != machine {
		return nil, fmt.Errorf("comm: LoadCostModel: %s was measured on %q, not %q", path, m.Machine, machine)
	}
	return &m, nil
}

// SaveCostModel writes m as JSON to the file at path atomically, creating
// its folder if needed.
func SaveCostModel(path string, m *CostModel) error {
	data, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return fmt.Errorf("comm: SaveCostModel: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("comm: SaveCostModel: %w", err)
	}
	if err := writeAtomic(path, data); err != nil {
		return fmt.Errorf("comm: SaveCostModel: %w", err)
	}
	return nil
}
