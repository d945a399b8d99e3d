package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/comm/rendezvous"
)

func op(t *testing.T, name string) benchOp {
	t.Helper()
	ops, err := parseOps(name)
	if err != nil || len(ops) != 1 {
		t.Fatalf("parseOps(%q) = %v, %v", name, ops, err)
	}
	return ops[0]
}

func TestParseSize(t *testing.T) {
	good := map[string]int64{
		"0": 0, "8": 8, "1K": 1024, "1k": 1024, "64M": 64 << 20, "2G": 2 << 30,
		"1KB": 1024, "1KiB": 1024, "16B": 16, " 3M ": 3 << 20,
	}
	for in, want := range good {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "K", "-1", "1.5M", "1T", "12X", "9999999999999G"} {
		if got, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) = %d, want an error", in, got)
		}
	}
}

func TestSizeSeries(t *testing.T) {
	got, err := sizeSeries(8, 64<<20, 8)
	if err != nil {
		t.Fatal(err)
	}
	want := []int64{8, 64, 512, 4096, 32768, 262144, 2097152, 16777216}
	if !slices.Equal(got, want) {
		t.Errorf("sizeSeries(8, 64M, 8) = %v, want %v", got, want)
	}
	if got, _ := sizeSeries(5, 5, 2); !slices.Equal(got, []int64{5}) {
		t.Errorf("sizeSeries(5, 5, 2) = %v", got)
	}
	for _, c := range [][3]int64{{0, 8, 2}, {16, 8, 2}, {8, 16, 1}} {
		if _, err := sizeSeries(c[0], c[1], c[2]); err == nil {
			t.Errorf("sizeSeries%v: want an error", c)
		}
	}
}

func TestShapeOf(t *testing.T) {
	tests := []struct {
		op                string
		size              int64
		ts, n             int
		param, send, recv int
		bytes             int64
	}{
		{"allreduce", 1 << 20, 4, 3, 262144, 262144, 262144, 1 << 20},
		{"allreduce", 7, 4, 2, 1, 1, 1, 4},
		{"broadcast", 64, 8, 5, 8, 8, 8, 64},
		{"reduce", 64, 2, 5, 32, 32, 32, 64},
		{"sendrecv", 1024, 4, 3, 256, 256, 256, 1024},
		// count 256, /3 = 85, & ^3 = 84.
		{"allgather", 1024, 4, 3, 84, 84, 252, 1008},
		{"reducescatter", 1024, 4, 3, 84, 252, 84, 1008},
		{"alltoall", 1024, 4, 3, 84, 252, 252, 1008},
		// float64: mask &^1; count 128, /3 = 42.
		{"allgather", 1024, 8, 3, 42, 42, 126, 1008},
		// uint8: mask &^15; count 1000, /3 = 333 -> 320.
		{"reducescatter", 1000, 1, 3, 320, 960, 320, 960},
		// too small to hold one aligned block.
		{"alltoall", 8, 4, 2, 0, 0, 0, 0},
	}
	for _, tt := range tests {
		sh := shapeOf(op(t, tt.op), tt.size, tt.ts, tt.n)
		if sh.paramCount != tt.param || sh.sendCount != tt.send || sh.recvCount != tt.recv || sh.bytes != tt.bytes {
			t.Errorf("shapeOf(%s, %d, ts=%d, n=%d) = count %d send %d recv %d bytes %d; want %d %d %d %d",
				tt.op, tt.size, tt.ts, tt.n, sh.paramCount, sh.sendCount, sh.recvCount, sh.bytes,
				tt.param, tt.send, tt.recv, tt.bytes)
		}
	}
}

func TestAlltoallvCounts(t *testing.T) {
	// n = 3: W = 6; weights row r = 1+(r+j)%3.
	send, recv := alltoallvCounts(100, 3)
	wantSend := [][]int{
		{16, 33, 51}, // 100·1/6, 100·2/6, 100·3/6 = 16, 33, 50; remainder 1 to j=2
		{33, 50, 17}, // 33, 50, 16 + 1
		{50, 16, 34}, // 50, 16, 33 + 1
	}
	if !slices.EqualFunc(send, wantSend, slices.Equal) {
		t.Errorf("send counts = %v, want %v", send, wantSend)
	}
	for r := range 3 {
		for j := range 3 {
			if recv[r][j] != send[j][r] {
				t.Errorf("recv[%d][%d] = %d, want send[%d][%d] = %d", r, j, recv[r][j], j, r, send[j][r])
			}
		}
	}
	for _, c := range [][2]int{{0, 1}, {1, 1}, {5, 4}, {1000, 7}, {3, 8}} {
		s, n := c[0], c[1]
		send, _ := alltoallvCounts(s, n)
		for r := range n {
			if sum(send[r]) != s {
				t.Errorf("alltoallvCounts(%d, %d): rank %d sends %d elements", s, n, r, sum(send[r]))
			}
		}
	}
	// The size is the largest per-rank total: rank 2 receives 51+17+34.
	sh := shapeOf(op(t, "alltoallv"), 400, 4, 3)
	if sh.paramCount != 100 || sh.sendCount != 100 || sh.recvCount != 102 || sh.bytes != 408 {
		t.Errorf("shapeOf(alltoallv, 400, 4, 3) = %+v", sh)
	}
}

func TestBusFactor(t *testing.T) {
	tests := map[string][2]float64{ // op: factor at n=4, at n=1
		"allreduce": {1.5, 0}, "allgather": {0.75, 0}, "reducescatter": {0.75, 0},
		"alltoall": {0.75, 0}, "alltoallv": {0.75, 0},
		"broadcast": {1, 1}, "reduce": {1, 1}, "sendrecv": {1, 1},
	}
	for name, want := range tests {
		if got := busFactor(op(t, name), 4); got != want[0] {
			t.Errorf("busFactor(%s, 4) = %g, want %g", name, got, want[0])
		}
		if got := busFactor(op(t, name), 1); got != want[1] {
			t.Errorf("busFactor(%s, 1) = %g, want %g", name, got, want[1])
		}
	}
	alg, bus := bandwidths(op(t, "allreduce"), 2, 2e9, 0.5)
	if alg != 4 || bus != 4 {
		t.Errorf("bandwidths(allreduce, 2, 2e9 B, 0.5 s) = %g, %g; want 4, 4", alg, bus)
	}
}

func TestHeader(t *testing.T) {
	// The column names as given in the design brief; the units line puts
	// each unit under the right end of its column.
	wantNames := "#       size         count      type   redop    root     time   algbw   busbw  %ceil #wrong     time   algbw   busbw  %ceil #wrong"
	wantUnits := "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)                   (us)  (GB/s)  (GB/s)"
	if got := header(true); got != wantNames+"\n"+wantUnits+"\n" {
		t.Errorf("header(true) =\n%s\nwant\n%s\n%s", got, wantNames, wantUnits)
	}
	if got := header(false); got != wantNames[:91]+"\n"+wantUnits[:77]+"\n" {
		t.Errorf("header(false) =\n%s", got)
	}
}

func TestRowFormatAligned(t *testing.T) {
	j := &job{op: op(t, "allreduce"), dtype: comm.Float32, redop: comm.Sum, ranks: 2, iters: 3, check: true}
	r := row{job: j, shape: shapeOf(j.op, 1024, 4, 2), cells: []cell{
		{variant: outOfPlace, median: 12345 * time.Nanosecond, algbw: 0.08, busbw: 0.08, checked: true},
		{variant: inPlace, median: 7 * time.Microsecond, algbw: 0.15, busbw: 0.15, wrong: 3, checked: true},
	}}
	line := r.format(10)
	head := strings.SplitN(header(true), "\n", 2)[0]
	if len(line)-1 != len(head) {
		t.Errorf("row is %d wide, header %d:\n%s%s", len(line)-1, len(head), head+"\n", line)
	}
	for _, f := range []string{"1024", "256", "float32", "sum", "-1", "12.35", "7.00", "0.8", "3"} {
		if !strings.Contains(line, " "+f) {
			t.Errorf("row %q lacks %q", line, f)
		}
	}
	recs := r.csvRecords("local")
	if len(recs) != 2 || recs[1][10] != "inplace;wrong=3" || recs[0][0] != "loom-local" || recs[0][2] != "auto" || recs[0][6] != "12.345" {
		t.Errorf("csvRecords = %q", recs)
	}
	var buf bytes.Buffer
	if err := writeCSVTo(&buf, recs); err != nil {
		t.Fatal(err)
	}
	if first := strings.SplitN(buf.String(), "\n", 2)[0]; first != "impl,op,variant,nranks,bytes,iters,time_us,min_us,algbw_GBps,busbw_GBps,note" {
		t.Errorf("CSV header = %q", first)
	}
}

func TestStats(t *testing.T) {
	ms := time.Millisecond
	durs := [][]time.Duration{{1 * ms, 5 * ms, 3 * ms, 2 * ms}, {2 * ms, 1 * ms, 3 * ms, 9 * ms}}
	it := iterationTimes(durs)
	if !slices.Equal(it, []time.Duration{2 * ms, 5 * ms, 3 * ms, 9 * ms}) {
		t.Errorf("iterationTimes = %v", it)
	}
	if m := median(it); m != 4*ms {
		t.Errorf("median = %v, want 4ms", m)
	}
	if m := median(it[:3]); m != 3*ms {
		t.Errorf("median of 3 = %v, want 3ms", m)
	}
}

// TestCheck runs the expected-value logic against a serial simulation of
// each operation's layout, and makes sure a corrupted output is caught.
func TestCheck(t *testing.T) {
	for _, dt := range comm.AllDTypes() {
		for _, red := range comm.AllReduceOps() {
			for _, name := range []string{"allreduce", "allgather", "reducescatter", "broadcast", "reduce", "alltoall", "alltoallv", "sendrecv"} {
				o := op(t, name)
				if !o.op.Reduces() && red != comm.Sum {
					continue
				}
				for _, variant := range []string{outOfPlace, inPlace} {
					if variant == inPlace && !o.inPlace() {
						continue
					}
					checkSimulated(t, o, variant, dt, red, 3, 256)
				}
			}
		}
	}
}

// checkSimulated lays out op on p ranks, computes every output serially from
// the inputs, and expects no wrong element; then flips one output element
// and expects exactly one.
func checkSimulated(t *testing.T, o benchOp, variant string, dt comm.DType, red comm.ReduceOp, p int, size int64) {
	t.Helper()
	sh := shapeOf(o, size, dt.Size(), p)
	prod := o.op.Reduces() && red == comm.Prod
	ls := make([]layout, p)
	for r := range p {
		sl, bl := bufferLens(o, sh, r)
		send, _ := comm.NewHostBuffer(dt, sl)
		buf, _ := comm.NewHostBuffer(dt, bl)
		ls[r] = layoutFor(o, sh, variant, r, p, 1, send, buf)
		ls[r].prepare(prod, true)
	}
	// Simulate: output element e of rank r is its source, as a float, from
	// the filled input buffers.
	inputOf := func(j, k int) float64 { return inputValue(dt, prod, j, k) }
	for r := range p {
		l := ls[r]
		if l.out == nil {
			continue
		}
		x := expectation{dt: dt, red: red, prod: prod, p: p, src: l.src}
		fill(l.out, func(e int) float64 {
			j, k := l.src(e)
			if j != allRanks {
				return inputOf(j, k)
			}
			v := inputOf(0, k)
			for q := 1; q < p; q++ {
				w := inputOf(q, k)
				switch red {
				case comm.Sum, comm.Avg:
					v += w
				case comm.Prod:
					v *= w
				case comm.Min:
					v = min(v, w)
				case comm.Max:
					v = max(v, w)
				}
			}
			if red == comm.Avg {
				v /= float64(p)
				if !dt.IsFloat() {
					v = float64(int64(v))
				}
			}
			return v
		})
		if w := countWrong(l.out, x); w != 0 {
			t.Errorf("%v %s %v %v rank %d: %d wrong in a correct output", o, variant, dt, red, r, w)
		}
		if l.out.Len() > 0 {
			b := l.out.Bytes()
			b[len(b)-1] ^= 0x40
			if w := countWrong(l.out, x); w != 1 {
				t.Errorf("%v %s %v %v rank %d: %d wrong after corrupting one element, want 1", o, variant, dt, red, r, w)
			}
		}
	}
}

func TestResolveAlgorithms(t *testing.T) {
	be := backend{algorithms: func(o comm.Op) []comm.Algorithm {
		if o == comm.OpAllReduce {
			return []comm.Algorithm{comm.Ring, comm.Tree}
		}
		return nil
	}}
	got, err := resolveAlgorithms([]string{"all"}, op(t, "allreduce"), be)
	if err != nil || !slices.Equal(got, []comm.Algorithm{comm.Auto, comm.Ring, comm.Tree}) {
		t.Errorf("all = %v, %v", got, err)
	}
	if _, err := resolveAlgorithms([]string{"ring"}, op(t, "sendrecv"), be); err == nil {
		t.Error("ring for sendrecv: want an error")
	}
	if _, err := resolveAlgorithms([]string{"bogus"}, op(t, "allreduce"), be); err == nil {
		t.Error("bogus algorithm: want an error")
	}
}

func TestParseFlags(t *testing.T) {
	var stderr bytes.Buffer
	cfg, err := parseFlags([]string{"-op", "allreduce,alltoallv", "-b", "1K", "-e", "1M", "-f", "32", "-dtype", "bf16"}, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.ops) != 2 || !slices.Equal(cfg.sizes, []int64{1024, 32768, 1 << 20}) || cfg.dtype != comm.BFloat16 {
		t.Errorf("cfg = %+v", cfg)
	}
	for _, args := range [][]string{{"-op", "gather"}, {"-ranks", "0"}, {"-root", "2"}, {"-f", "1"}, {"-redop", "xor"}} {
		if _, err := parseFlags(args, &stderr); err == nil {
			t.Errorf("parseFlags(%q): want an error", args)
		}
	}
	if code := run(t.Context(), []string{"-backend", "mpi"}, &stderr, &stderr); code != 2 ||
		!strings.Contains(stderr.String(), `backend "mpi" is not available`) {
		t.Errorf("run -backend mpi = %d, stderr %q", code, stderr.String())
	}
}

// TestCSVOneWriter runs loombench as a job of one rank per process does:
// each simulated process runs bench with the same -csv path, holding one
// rank of a shared in-process world, and the process of rank 1 (which
// measures but builds no rows) finishes last. The file must hold rank 0's
// rows, whichever process ends last.
func TestCSVOneWriter(t *testing.T) {
	t.Setenv(comm.CostModelEnv, comm.CostModelOff)
	const procs = 3
	path := filepath.Join(t.TempDir(), "out.csv")
	for _, last := range []int{0, procs - 1} {
		t.Run(fmt.Sprint("last=", last), func(t *testing.T) {
			if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
				t.Fatal(err)
			}
			wd, err := local.NewWorld(procs, local.WithOptions(comm.Options{Timeout: 30 * time.Second}))
			if err != nil {
				t.Fatal(err)
			}
			codes := make([]int, procs)
			outs := make([]bytes.Buffer, procs)
			var wg sync.WaitGroup
			for i := range procs {
				be := backend{
					run: func(ctx context.Context, p int, _ comm.Options, fn func(context.Context, comm.Communicator) error) error {
						err := fn(ctx, wd.Comm(i))
						if i == last {
							time.Sleep(100 * time.Millisecond) // reaches -csv after the others
						}
						return err
					},
					algorithms: local.Algorithms,
					world:      func() (int, int, error) { return procs, i, nil },
				}
				cfg, err := parseFlags([]string{"-backend", "fake", "-op", "allreduce,allgather", "-b", "1K", "-e", "4K", "-f", "4", "-iters", "2", "-warmup", "0", "-csv", path}, &outs[i])
				if err != nil {
					t.Fatal(err)
				}
				cfg.copySize = 1 << 16
				wg.Add(1)
				go func() {
					defer wg.Done()
					codes[i] = bench(t.Context(), cfg, be, &outs[i], &outs[i])
				}()
			}
			wg.Wait()
			for i, code := range codes {
				if code != 0 {
					t.Fatalf("process %d: exit %d: %s", i, code, outs[i].String())
				}
			}
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			recs, err := csv.NewReader(f).ReadAll()
			if err != nil {
				t.Fatal(err)
			}
			// A header, and one row per op and size (1K and 4K).
			if len(recs) != 1+2*2 {
				t.Errorf("%d CSV lines, want %d:\n%v", len(recs), 1+2*2, recs)
			}
			if tmp, _ := filepath.Glob(filepath.Join(filepath.Dir(path), ".*tmp*")); len(tmp) > 0 {
				t.Errorf("temporary files left: %v", tmp)
			}
		})
	}
}

// TestTCPBackend runs loombench -backend tcp as loomrun's processes do,
// each simulated process with its own environment (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) and its own rank of one TCP world over
// loopback: every op and algorithm measured is checked against the serial
// reference (no wrong element), only rank 0 prints the table, and a
// process without loomrun's environment is refused, naming what to do.
func TestTCPBackend(t *testing.T) {
	const procs = 3
	srv, err := rendezvous.Listen(t.Context(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	host, port, err := net.SplitHostPort(srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	codes := make([]int, procs)
	outs := make([]bytes.Buffer, procs)
	var wg sync.WaitGroup
	for i := range procs {
		vars := map[string]string{"RANK": fmt.Sprint(i), "WORLD_SIZE": fmt.Sprint(procs), "MASTER_ADDR": host, "MASTER_PORT": port}
		be := tcpBackend(func(k string) string { return vars[k] })
		cfg, err := parseFlags([]string{"-backend", "tcp", "-op", "allreduce,reducescatter,alltoall", "-algo", "all", "-b", "1K", "-e", "64K", "-f", "8", "-iters", "2", "-warmup", "1", "-timeout", "1m"}, &outs[i])
		if err != nil {
			t.Fatal(err)
		}
		cfg.copySize = 1 << 16
		wg.Go(func() { codes[i] = bench(t.Context(), cfg, be, &outs[i], &outs[i]) })
	}
	wg.Wait()
	for i, code := range codes {
		if code != 0 {
			t.Fatalf("process %d: exit %d: %s", i, code, outs[i].String())
		}
	}
	out := outs[0].String()
	for _, want := range []string{"backend=tcp ranks=3", "op=allreduce algo=ring", "op=reducescatter algo=direct", "op=alltoall algo=auto"} {
		if !strings.Contains(out, want) {
			t.Errorf("rank 0's output lacks %q:\n%s", want, out)
		}
	}
	// Rows: 3 sizes of allreduce (auto, direct, ring, tree),
	// reducescatter (auto, direct, ring) and alltoall (auto, direct), each
	// ending with its count of wrong elements, 0.
	rows := 0
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) > 0 && !strings.HasPrefix(line, "#") {
			rows++
			if f[len(f)-1] != "0" {
				t.Errorf("row %q: wrong elements", line)
			}
		}
	}
	if rows != 3*(4+3+2) || strings.Contains(out, "# error") {
		t.Errorf("rank 0 printed %d rows, want %d, or errors:\n%s", rows, 3*(4+3+2), out)
	}
	if outs[1].Len() != 0 || outs[2].Len() != 0 {
		t.Errorf("ranks 1 and 2 printed %q and %q; want nothing", outs[1].String(), outs[2].String())
	}

	var stderr bytes.Buffer
	cfg, err := parseFlags([]string{"-backend", "tcp"}, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	if code := bench(t.Context(), cfg, tcpBackend(func(string) string { return "" }), &stderr, &stderr); code != 2 || !strings.Contains(stderr.String(), "start loombench with loomrun") {
		t.Errorf("without loomrun's environment: exit %d, %q; want 2 and how to start it", code, stderr.String())
	}
}
