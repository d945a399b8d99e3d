//go:build linux && (amd64 || arm64)

package nccl

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

// cFields are the ncclConfig_t field names after the header, in order, as
// nccl.h spells them.
var cFields = []string{"blocking", "cgaClusterSize", "minCTAs", "maxCTAs", "netName", "splitShare", "trafficClass",
	"commName", "collnetEnable", "CTAPolicy", "shrinkShare", "nvlsCTAs", "nChannelsPerNetPeer", "nvlinkCentricSched",
	"graphUsageMode", "numRmaCtx", "maxP2pPeers", "graphStreamOrdering"}

// cLayouts are the layout versions the fake compiles a struct for.
var cLayouts = []int{21400, 21700, 21800, 22600, 22700, 22800, 22900, 23000, 23005}

// cLayoutOf is the newest layout at or below a release.
func cLayoutOf(v int) int {
	out := 0
	for _, l := range cLayouts {
		if l <= v {
			out = l
		}
	}
	return out
}

// TestConfigLayouts checks LayoutFor against structs that gcc lays out
// from nccl.h's field lists (testdata/fakenccl.c): sizeof and every
// offset, for every layout, and the size and version written for a range
// of releases (sizeof 2.14=24, 2.17=40, 2.18..2.26=48, 2.27=72, 2.28=80,
// 2.29=88, 2.30=96).
func TestConfigLayouts(t *testing.T) {
	f := useFake(t)
	for _, v := range cLayouts {
		t.Run(VersionString(v), func(t *testing.T) {
			l, err := LayoutFor(v)
			if err != nil {
				t.Fatal(err)
			}
			if want := f.cfgSizeof(int32(v)); int64(l.Size) != want {
				t.Errorf("Size = %d, gcc says sizeof = %d", l.Size, want)
			}
			for _, hdr := range []struct {
				name string
				off  int64
			}{{"size", 0}, {"magic", 8}, {"version", 12}} {
				if got := f.cfgOffsetof(int32(v), hdr.name); got != hdr.off {
					t.Errorf("gcc offsetof(%s) = %d, want %d", hdr.name, got, hdr.off)
				}
			}
			for _, name := range cFields {
				want := f.cfgOffsetof(int32(v), name)
				i := slices.IndexFunc(l.Fields, func(cf ConfigField) bool { return cf.Name == name })
				switch {
				case want < 0 && i >= 0:
					t.Errorf("field %s is in the Go layout but not in nccl.h %s", name, VersionString(v))
				case want >= 0 && i < 0:
					t.Errorf("field %s (offset %d) is missing from the Go layout", name, want)
				case i >= 0 && int64(l.Fields[i].Offset) != want:
					t.Errorf("offsetof(%s) = %d, gcc says %d", name, l.Fields[i].Offset, want)
				}
			}
		})
	}
	releases := []struct {
		v, size, written int
	}{
		{21403, 24, 21403}, {21605, 24, 21605}, {21702, 40, 21702}, {21803, 48, 21803}, {22105, 48, 22105},
		{22505, 48, 22505}, {22605, 48, 22605}, {22703, 72, 22703}, {22803, 80, 22803}, {22907, 88, 22907},
		{23003, 96, 23003}, {23007, 96, 23005}, {23100, 96, 23005},
	}
	for _, r := range releases {
		l, err := LayoutFor(r.v)
		if err != nil {
			t.Fatalf("%d: %v", r.v, err)
		}
		if l.Size != r.size || l.Version != r.written {
			t.Errorf("NCCL %s: size %d version %d, want %d, %d", VersionString(r.v), l.Size, l.Version, r.size, r.written)
		}
		if want := f.cfgSizeof(int32(cLayoutOf(r.v))); int64(l.Size) != want {
			t.Errorf("NCCL %s: size %d, gcc %d", VersionString(r.v), l.Size, want)
		}
	}
	if _, err := LayoutFor(21305); !errors.Is(err, comm.ErrUnsupported) {
		t.Errorf("LayoutFor(2.13.5) = %v, want ErrUnsupported", err)
	}
}

// expectedConfig builds the ncclConfig_t bytes a release should get from
// the gcc offsets: every field unset (INT_MIN or NULL) except those in
// set (ints; pointers are checked apart).
func expectedConfig(f *fake, v int, set map[string]int32) []byte {
	lv := cLayoutOf(v)
	size := int(f.cfgSizeof(int32(lv)))
	b := make([]byte, size)
	binary.LittleEndian.PutUint64(b, uint64(size))
	binary.LittleEndian.PutUint32(b[8:], 0xcafebeef)
	binary.LittleEndian.PutUint32(b[12:], uint32(min(v, 23005)))
	for _, name := range cFields {
		off := f.cfgOffsetof(int32(lv), name)
		if off < 0 {
			continue
		}
		if name == "netName" || name == "commName" {
			continue // NULL: zero bytes
		}
		val := int32(undefInt)
		if x, ok := set[name]; ok {
			val = x
		}
		binary.LittleEndian.PutUint32(b[off:], uint32(val))
	}
	return b
}

// fullConfig sets every int field a release knows to a distinct value.
func fullConfig(v int) (Config, map[string]int32) {
	cfg := Config{}
	set := map[string]int32{"blocking": 0}
	fields := []struct {
		name string
		dst  *Value
	}{
		{"cgaClusterSize", &cfg.CGAClusterSize}, {"minCTAs", &cfg.MinCTAs}, {"maxCTAs", &cfg.MaxCTAs},
		{"splitShare", &cfg.SplitShare}, {"trafficClass", &cfg.TrafficClass}, {"collnetEnable", &cfg.CollnetEnable},
		{"CTAPolicy", &cfg.CTAPolicy}, {"shrinkShare", &cfg.ShrinkShare}, {"nvlsCTAs", &cfg.NVLSCTAs},
		{"nChannelsPerNetPeer", &cfg.NChannelsPerNetPeer}, {"nvlinkCentricSched", &cfg.NVLinkCentricSched},
		{"graphUsageMode", &cfg.GraphUsageMode}, {"numRmaCtx", &cfg.NumRMACtx}, {"maxP2pPeers", &cfg.MaxP2PPeers},
		{"graphStreamOrdering", &cfg.GraphStreamOrdering},
	}
	for i, fl := range fields {
		if sinceOf(fl.name) <= min(v, newestLayout) {
			*fl.dst = Int(int32(100 + i))
			set[fl.name] = int32(100 + i)
		}
	}
	return cfg, set
}

// TestInitMarshalling creates a one-rank communicator for a range of NCCL
// releases, through the by-value stub (or arm64's pointer) and through
// ncclCommInitRankScalable, and checks what the fake received: the 128
// id bytes passed by value, and every byte of the ncclConfig_t.
func TestInitMarshalling(t *testing.T) {
	f := useFake(t)
	versions := []int{21403, 21702, 21803, 22105, 22304, 22505, 22605, 22703, 22803, 22907, 23003, 23007, 23100}
	paths := []string{"default", "scalable"}
	for _, v := range versions {
		for _, path := range paths {
			for _, full := range []bool{false, true} {
				name := fmt.Sprintf("%s/%s/full=%v", VersionString(v), path, full)
				t.Run(name, func(t *testing.T) {
					f.reset()
					f.setVersion(int32(v))
					var opts []LoadOption
					if path == "scalable" {
						opts = append(opts, func(c *loadConfig) { c.initVia = "scalable" })
					}
					l := f.load(t, opts...)
					wantVia := map[string]string{"amd64": "thunk", "arm64": "pointer"}[runtime.GOARCH]
					if path == "scalable" {
						wantVia = "scalable"
					}
					if l.InitPath() != wantVia {
						t.Errorf("InitPath = %q, want %q", l.InitPath(), wantVia)
					}
					d, err := l.Driver().Open(0)
					if err != nil {
						t.Fatal(err)
					}
					defer d.Close()
					id, err := l.UniqueID()
					if err != nil {
						t.Fatal(err)
					}
					cfg, set := Config{}, map[string]int32{"blocking": 0}
					if full {
						cfg, set = fullConfig(v)
					}
					f.logClear()
					c, err := l.NewCommFromID(context.Background(), d, id, 0, 1, WithConfig(cfg), WithOptions(comm.Options{}))
					if err != nil {
						t.Fatal(err)
					}
					defer c.Close()
					fn := "ncclCommInitRankConfig"
					if path == "scalable" {
						fn = "ncclCommInitRankScalable"
						if got := f.lines("ncclCommInitRankScalable nId="); len(got) != 1 || got[0] != "ncclCommInitRankScalable nId=1" {
							t.Errorf("scalable call: %q", got)
						}
					}
					want := fmt.Sprintf("%s nranks=1 rank=0 id=%s config=%s", fn, hexOf(id[:]), hexOf(expectedConfig(f, v, set)))
					got := f.lines(fn + " nranks=")
					if len(got) != 1 || got[0] != want {
						t.Errorf("init call:\n got %q\nwant %q", got, want)
					}
					f.clean(t)
				})
			}
		}
	}
}

// TestConfigStrings checks that NetName and CommName reach NCCL as
// pointers to NUL-terminated copies, and that fields the loaded NCCL lacks
// are an error naming them.
func TestConfigStrings(t *testing.T) {
	var pin runtime.Pinner
	defer pin.Unpin()
	l, _ := LayoutFor(22803)
	b, err := l.encode(&Config{NetName: "ib0", CommName: "loom"}, &pin)
	if err != nil {
		t.Fatal(err)
	}
	for _, fld := range []struct {
		off  int
		want string
	}{{32, "ib0"}, {48, "loom"}} {
		p := binary.LittleEndian.Uint64(b[fld.off:])
		if p == 0 {
			t.Fatalf("pointer at %d is NULL", fld.off)
		}
		if got := goString(pointerAt(b, fld.off)); got != fld.want {
			t.Errorf("string at %d = %q, want %q", fld.off, got, fld.want)
		}
	}
	cases := []struct {
		version int
		cfg     Config
		want    error
		mention string
	}{
		{21803, Config{CommName: "x"}, comm.ErrUnsupported, "Config.CommName (ncclConfig_t.commName) needs NCCL 2.27.0"},
		{22803, Config{MaxP2PPeers: Int(4)}, comm.ErrUnsupported, "Config.MaxP2PPeers"},
		{21403, Config{MinCTAs: Int(1)}, comm.ErrUnsupported, "needs NCCL 2.17.0"},
		{23005, Config{NetName: "a\x00b"}, comm.ErrInvalid, "NUL"},
		{21403, Config{Blocking: true}, nil, ""},
	}
	for _, tc := range cases {
		l, _ := LayoutFor(tc.version)
		_, err := l.encode(&tc.cfg, &pin)
		if tc.want == nil {
			if err != nil {
				t.Errorf("%d: %v", tc.version, err)
			}
			continue
		}
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.mention) {
			t.Errorf("%d %+v: err = %v, want %v mentioning %q", tc.version, tc.cfg, err, tc.want, tc.mention)
		}
	}
}

// marshal runs one call on a one-rank communicator and returns the NCCL
// call lines it logged, without the comm and stream fields, which are
// checked once per line.
func marshal(t *testing.T, f *fake, c *Comm, call comm.Call) []string {
	t.Helper()
	f.logClear()
	if err := c.Do(context.Background(), call); err != nil {
		t.Fatalf("%v: %v", call.Op, err)
	}
	var out []string
	suffix := fmt.Sprintf(" comm=%s stream=%s", ptr(c.h), ptr(c.stream.Handle()))
	for _, l := range strings.Split(f.log(), "\n") {
		if !strings.HasPrefix(l, "nccl") {
			continue
		}
		if strings.Contains(l, " comm=") {
			if !strings.HasSuffix(l, suffix) {
				t.Errorf("%q does not end with %q", l, suffix)
			}
			l = strings.TrimSuffix(l, suffix)
		}
		out = append(out, l)
	}
	return out
}

// TestCollectiveMarshalling checks the arguments of every NCCL call for
// every collective on device buffers: pointers, counts, datatypes, ops,
// roots and peers, the communicator and the stream, with the native
// AllToAll/Gather/Scatter (NCCL 2.28) and with grouped send/recv (2.21),
// and that the event is recorded on the communicator's stream after the
// call has settled.
func TestCollectiveMarshalling(t *testing.T) {
	f := useFake(t)
	for _, version := range []int32{22803, 22105} {
		t.Run(VersionString(int(version)), func(t *testing.T) {
			f.reset()
			f.setVersion(version)
			f.setSettle(3)
			l := f.load(t)
			w := newWorld(t, l, 1)
			defer w.close()
			c, d := w.comms[0], w.devs[0]
			native := version >= 22800
			dtypes := []struct {
				dt   comm.DType
				code int
			}{{comm.Float32, 7}, {comm.Float64, 8}, {comm.BFloat16, 9}, {comm.Float16, 6}, {comm.Int32, 2}, {comm.Int64, 4}, {comm.Uint8, 1}}
			ops := []struct {
				op   comm.ReduceOp
				code int
			}{{comm.Sum, 0}, {comm.Prod, 1}, {comm.Max, 2}, {comm.Min, 3}, {comm.Avg, 4}}
			for _, dt := range dtypes {
				s, err := allocDev(d, dt.dt, 6)
				if err != nil {
					t.Fatal(err)
				}
				r, err := allocDev(d, dt.dt, 6)
				if err != nil {
					t.Fatal(err)
				}
				sp, rp := ptr(s.Ptr()), ptr(r.Ptr())
				for _, op := range ops {
					got := marshal(t, f, c, comm.Call{Op: comm.OpAllReduce, Send: s, Recv: r, Reduce: op.op})
					want := []string{fmt.Sprintf("ncclAllReduce send=%s recv=%s count=6 dt=%d op=%d", sp, rp, dt.code, op.code)}
					if !slices.Equal(got, want) {
						t.Errorf("allreduce %v %v:\n got %q\nwant %q", dt.dt, op.op, got, want)
					}
				}
				cases := []struct {
					call comm.Call
					want []string
				}{
					{comm.Call{Op: comm.OpAllReduce, Send: s, Recv: s, Reduce: comm.Max},
						[]string{fmt.Sprintf("ncclAllReduce send=%s recv=%s count=6 dt=%d op=2", sp, sp, dt.code)}},
					{comm.Call{Op: comm.OpBroadcast, Send: r, Recv: r, Root: 0},
						[]string{fmt.Sprintf("ncclBroadcast send=%s recv=%s count=6 dt=%d root=0", rp, rp, dt.code)}},
					{comm.Call{Op: comm.OpBroadcast, Send: s, Recv: r},
						[]string{fmt.Sprintf("ncclBroadcast send=%s recv=%s count=6 dt=%d root=0", sp, rp, dt.code)}},
					{comm.Call{Op: comm.OpReduce, Send: s, Recv: r, Reduce: comm.Min},
						[]string{fmt.Sprintf("ncclReduce send=%s recv=%s count=6 dt=%d op=3 root=0", sp, rp, dt.code)}},
					{comm.Call{Op: comm.OpAllGather, Send: s.Slice(0, 4), Recv: r.Slice(1, 5)},
						[]string{fmt.Sprintf("ncclAllGather send=%s recv=%s count=4 dt=%d", sp, ptr(r.Ptr()+uintptr(dt.dt.Size())), dt.code)}},
					{comm.Call{Op: comm.OpReduceScatter, Send: s, Recv: r, Reduce: comm.Avg},
						[]string{fmt.Sprintf("ncclReduceScatter send=%s recv=%s count=6 dt=%d op=4", sp, rp, dt.code)}},
					{comm.Call{Op: comm.OpBarrier},
						[]string{fmt.Sprintf("ncclAllReduce send=%s recv=%s count=1 dt=7 op=0", ptr(uintptr(c.barrier.Ptr)), ptr(uintptr(c.barrier.Ptr)))}},
				}
				grouped := func(send bool, p string, n int) string {
					if send {
						return fmt.Sprintf("ncclSend buf=%s count=%d dt=%d peer=0", p, n, dt.code)
					}
					return fmt.Sprintf("ncclRecv buf=%s count=%d dt=%d peer=0", p, n, dt.code)
				}
				if native {
					cases = append(cases,
						struct {
							call comm.Call
							want []string
						}{comm.Call{Op: comm.OpAllToAll, Send: s, Recv: r}, []string{fmt.Sprintf("ncclAlltoAll send=%s recv=%s count=6 dt=%d", sp, rp, dt.code)}},
						struct {
							call comm.Call
							want []string
						}{comm.Call{Op: comm.OpGather, Send: s, Recv: r}, []string{fmt.Sprintf("ncclGather send=%s recv=%s count=6 dt=%d root=0", sp, rp, dt.code)}},
						struct {
							call comm.Call
							want []string
						}{comm.Call{Op: comm.OpScatter, Send: s, Recv: r}, []string{fmt.Sprintf("ncclScatter send=%s recv=%s count=6 dt=%d root=0", sp, rp, dt.code)}})
				} else {
					cases = append(cases,
						struct {
							call comm.Call
							want []string
						}{comm.Call{Op: comm.OpAllToAll, Send: s, Recv: r}, []string{"ncclGroupStart", grouped(true, sp, 6), grouped(false, rp, 6), "ncclGroupEnd"}},
						struct {
							call comm.Call
							want []string
						}{comm.Call{Op: comm.OpGather, Send: s, Recv: r}, []string{"ncclGroupStart", grouped(false, rp, 6), grouped(true, sp, 6), "ncclGroupEnd"}},
						struct {
							call comm.Call
							want []string
						}{comm.Call{Op: comm.OpScatter, Send: s, Recv: r}, []string{"ncclGroupStart", grouped(true, sp, 6), grouped(false, rp, 6), "ncclGroupEnd"}})
				}
				for _, tc := range cases {
					got := marshal(t, f, c, tc.call)
					if !slices.Equal(got, tc.want) {
						t.Errorf("%v %v:\n got %q\nwant %q", tc.call.Op, dt.dt, got, tc.want)
					}
				}
				// AllToAllV: the count exchange (an allgather of 16p+240
				// bytes), then every peer's send and receive.
				got := marshal(t, f, c, comm.Call{Op: comm.OpAllToAllV, Send: s, Recv: r, SendCounts: []int{5}, RecvCounts: []int{5}})
				if len(got) != 5 || !strings.HasPrefix(got[0], "ncclAllGather") || !strings.HasSuffix(got[0], " count=256 dt=1") ||
					!slices.Equal(got[1:], []string{"ncclGroupStart", grouped(true, sp, 5), grouped(false, rp, 5), "ncclGroupEnd"}) {
					t.Errorf("alltoallv %v: %q", dt.dt, got)
				}
				if err := errors.Join(s.Free(), r.Free()); err != nil {
					t.Fatal(err)
				}
			}
			// The event is recorded on the communicator's stream after the
			// call: the fake posts work only after the settle polls, so an
			// early record would complete before the data moved (the
			// conformance test catches that as wrong data).
			f.logClear()
			polls := f.asyncPolls()
			if err := comm.Barrier(context.Background(), c); err != nil {
				t.Fatal(err)
			}
			if n := f.asyncPolls() - polls; n < 3 {
				t.Errorf("%d ncclCommGetAsyncError polls, want at least the 3 settle polls", n)
			}
			lines := f.lines()
			i := slices.IndexFunc(lines, func(s string) bool { return strings.HasPrefix(s, "ncclAllReduce") })
			j := slices.IndexFunc(lines, func(s string) bool {
				return strings.HasPrefix(s, "cuEventRecord") && strings.HasSuffix(s, "stream="+ptr(c.stream.Handle()))
			})
			if i < 0 || j < i {
				t.Errorf("want ncclAllReduce then cuEventRecord on the stream:\n%s", strings.Join(lines, "\n"))
			}
			f.clean(t)
		})
	}
}

// TestGroupedMarshalling checks the grouped forms on three ranks with
// device buffers: Gather and Scatter (root 1) and AllToAll before NCCL
// 2.28, and AllToAllV with ragged counts: every peer gets a send and a
// receive at the packed offsets, zero-length ones included.
func TestGroupedMarshalling(t *testing.T) {
	f := useFake(t)
	f.setVersion(22105)
	l := f.load(t)
	const p, n = 3, 2
	w := newWorld(t, l, p)
	defer w.close()
	counts := [p][p]int{{1, 0, 2}, {3, 1, 0}, {0, 2, 2}} // counts[i][j]: i sends to j
	var sbase, rbase [p]uintptr
	err := w.run(func(r int, c *Comm) error {
		d := w.devs[r]
		s, err := allocDev(d, comm.Int32, 6)
		if err != nil {
			return err
		}
		defer s.Free()
		rb, err := allocDev(d, comm.Int32, 6)
		if err != nil {
			return err
		}
		defer rb.Free()
		sbase[r], rbase[r] = s.Ptr(), rb.Ptr()
		ctx := context.Background()
		if err := comm.Gather(ctx, c, s.Slice(0, n), rb, 1); err != nil {
			return err
		}
		if err := comm.Scatter(ctx, c, s, rb.Slice(0, n), 1); err != nil {
			return err
		}
		if err := comm.AllToAll(ctx, c, s, rb); err != nil {
			return err
		}
		var sc, rc []int
		for j := range p {
			sc = append(sc, counts[r][j])
			rc = append(rc, counts[j][r])
		}
		return comm.AllToAllV(ctx, c, s, rb, sc, rc)
	})
	if err != nil {
		t.Fatal(err)
	}
	for r, c := range w.comms {
		var got, want []string
		for _, line := range f.lines("comm=" + ptr(c.h)) {
			if strings.HasPrefix(line, "ncclSend") || strings.HasPrefix(line, "ncclRecv") {
				got = append(got, strings.Join(strings.Fields(line)[:5], " "))
			}
		}
		add := func(send bool, a uintptr, count, peer int) {
			op := "ncclRecv"
			if send {
				op = "ncclSend"
			}
			want = append(want, fmt.Sprintf("%s buf=%s count=%d dt=2 peer=%d", op, ptr(a), count, peer))
		}
		s, rb := sbase[r], rbase[r]
		if r == 1 { // Gather, root 1
			for q := range p {
				add(false, rb+uintptr(4*q*n), n, q)
			}
		}
		add(true, s, n, 1)
		if r == 1 { // Scatter, root 1
			for q := range p {
				add(true, s+uintptr(4*q*n), n, q)
			}
		}
		add(false, rb, n, 1)
		for q := range p { // AllToAll
			add(true, s+uintptr(4*q*n), n, q)
			add(false, rb+uintptr(4*q*n), n, q)
		}
		soff, roff := 0, 0
		for q := range p { // AllToAllV
			add(true, s+uintptr(4*soff), counts[r][q], q)
			add(false, rb+uintptr(4*roff), counts[q][r], q)
			soff += counts[r][q]
			roff += counts[q][r]
		}
		if !slices.Equal(got, want) {
			t.Errorf("rank %d:\n got %q\nwant %q", r, got, want)
		}
	}
	f.clean(t)
}

// pointerAt reads the pointer stored at b[off:].
func pointerAt(b []byte, off int) *byte {
	return *(**byte)(unsafe.Pointer(&b[off]))
}

// TestStagingMarshalling checks host buffers: each distinct span is
// staged in its own device allocation (copied in before the call, out
// after it, then freed), and the in-place forms share one allocation with
// the inner buffer at its offset.
func TestStagingMarshalling(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	w := newWorld(t, l, 1)
	defer w.close()
	c := w.comms[0]
	ctx := context.Background()
	allocs := func() []string { return f.lines("cuMemAlloc_v2 bytes=") }
	frees := func() []string { return f.lines("cuMemFree_v2") }

	// Out of place: two allocations, send copied in, recv copied out.
	send, recv := comm.Host([]float32{1, 2, 3}), comm.Host(make([]float32, 3))
	f.logClear()
	if err := comm.AllReduce(ctx, c, send, recv, comm.Sum); err != nil {
		t.Fatal(err)
	}
	if a := allocs(); len(a) != 2 || len(frees()) != 2 || len(f.lines("cuMemcpyHtoD_v2", "bytes=12")) != 1 || len(f.lines("cuMemcpyDtoH_v2", "bytes=12")) != 1 {
		t.Errorf("out of place:\n%s", f.log())
	}
	if !slices.Equal(recv.Float32s(), []float32{1, 2, 3}) {
		t.Errorf("recv = %v", recv.Float32s())
	}
	// In place: one allocation, the same pointer twice.
	f.logClear()
	if err := comm.AllReduce(ctx, c, send, send, comm.Sum); err != nil {
		t.Fatal(err)
	}
	a := allocs()
	if len(a) != 1 {
		t.Fatalf("in place: %d allocations:\n%s", len(a), f.log())
	}
	p := a[0][strings.Index(a[0], "-> ")+3:]
	if got := f.lines("ncclAllReduce send=" + p + " recv=" + p + " "); len(got) != 1 {
		t.Errorf("in place: want send == recv == %s:\n%s", p, f.log())
	}
	// AllGather in place on one rank is the whole buffer; ReduceScatter
	// in place likewise: one allocation each.
	for _, call := range []comm.Call{
		{Op: comm.OpAllGather, Send: send, Recv: send},
		{Op: comm.OpReduceScatter, Send: send, Recv: send, Reduce: comm.Sum},
	} {
		f.logClear()
		if err := c.Do(ctx, call); err != nil {
			t.Fatal(err)
		}
		if a := allocs(); len(a) != 1 {
			t.Errorf("%v in place: %d allocations", call.Op, len(a))
		}
	}
	// Zero-length collectives never reach NCCL.
	f.logClear()
	if err := comm.AllReduce(ctx, c, comm.Host([]float32{}), comm.Host([]float32{}), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if got := f.lines("nccl"); len(got) != 0 {
		t.Errorf("empty allreduce reached NCCL: %q", got)
	}
	// AllToAllV copies back only the received prefix.
	big := comm.Host([]int64{7, 7, 7, 7})
	if err := comm.AllToAllV(ctx, c, comm.Host([]int64{1, 2}), big, []int{2}, []int{2}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(big.Int64s(), []int64{1, 2, 7, 7}) {
		t.Errorf("alltoallv recv = %v, want [1 2 7 7]", big.Int64s())
	}
	f.clean(t)
}

// TestP2PBatchOrder checks that batched sends and receives go to NCCL as
// one group ordered by tag, so that receives posted in another order
// still match: rank 0 sends tags 7, 9, 7; rank 1 receives 9, 7, 7.
func TestP2PBatchOrder(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	w := newWorld(t, l, 2)
	defer w.close()
	ctx := context.Background()
	msgs := [][]int32{{1}, {2, 2}, {3, 3, 3}}
	tags := []int{7, 9, 7}
	got := make([][]int32, 3)
	err := w.run(func(r int, c *Comm) error {
		var works []comm.Work
		if r == 0 {
			for i, m := range msgs {
				wk, err := comm.SendAsync(ctx, c, comm.Host(m), 1, tags[i])
				if err != nil {
					return err
				}
				works = append(works, wk)
			}
		} else {
			for _, i := range []int{1, 0, 2} {
				got[i] = make([]int32, len(msgs[i]))
				wk, err := comm.RecvAsync(ctx, c, comm.Host(got[i]), 0, tags[i])
				if err != nil {
					return err
				}
				works = append(works, wk)
			}
		}
		return comm.WaitAll(ctx, works...)
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range msgs {
		if !slices.Equal(got[i], msgs[i]) {
			t.Errorf("message %d (tag %d): got %v, want %v", i, tags[i], got[i], msgs[i])
		}
	}
	for r, c := range w.comms {
		var counts []string
		for _, line := range f.lines("comm=" + ptr(c.h)) {
			if strings.HasPrefix(line, "ncclSend") || strings.HasPrefix(line, "ncclRecv") {
				counts = append(counts, strings.Fields(line)[2])
			}
		}
		if want := []string{"count=1", "count=3", "count=2"}; !slices.Equal(counts, want) {
			t.Errorf("rank %d issued %q, want tag order %q", r, counts, want)
		}
	}
	f.clean(t)
}
