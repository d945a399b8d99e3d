package nccl

import (
	"encoding/binary"
	"fmt"
	"math"
	"runtime"
	"strings"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

// MinVersion is the oldest NCCL this package drives (2.14.0, the first
// with ncclCommInitRankConfig and nonblocking communicators), as an
// NCCL_VERSION code.
const MinVersion = 21400

// newestLayout is the newest ncclConfig_t layout this package knows: NCCL
// 2.30.5 added graphStreamOrdering. A newer NCCL gets this layout and
// this version code, and resets the fields it added since to defaults.
const newestLayout = 23005

// configMagic is NCCL_API_MAGIC; NCCL rejects a config without it.
const configMagic = 0xcafebeef

// undefInt is NCCL_CONFIG_UNDEF_INT (INT_MIN): "use the default".
const undefInt = math.MinInt32

// undefBits is undefInt as the bits of a C int.
const undefBits = 1 << 31

// VersionCode returns the NCCL_VERSION code of major.minor.patch:
// X*10000+Y*100+Z from 2.9 on, X*1000+Y*100+Z before.
func VersionCode(major, minor, patch int) int {
	if major <= 2 && minor <= 8 {
		return major*1000 + minor*100 + patch
	}
	return major*10000 + minor*100 + patch
}

// VersionString formats an NCCL_VERSION code as "2.21.5".
func VersionString(code int) string {
	if code < 10000 {
		return fmt.Sprintf("%d.%d.%d", code/1000, code%1000/100, code%100)
	}
	return fmt.Sprintf("%d.%d.%d", code/10000, code%10000/100, code%100)
}

// Value is an optional int field of Config. The zero Value is unset, which
// NCCL reads as "use the default" (NCCL_CONFIG_UNDEF_INT).
type Value struct {
	v   int32
	set bool
}

// Int returns a Value set to v.
func Int(v int32) Value { return Value{v: v, set: true} }

// Get returns the value and whether it is set.
func (v Value) Get() (int32, bool) { return v.v, v.set }

// Config is the ncclConfig_t of a communicator. Every field left unset
// keeps NCCL's default. Fields that the loaded NCCL does not know are an
// error when set (NewComm names the field and the version it needs).
// Split communicators inherit their parent's config.
type Config struct {
	// Blocking makes NCCL calls block until their work is enqueued
	// (ncclConfig_t.blocking = 1). The default, false, is NCCL's
	// nonblocking mode: calls return ncclInProgress and loom polls
	// ncclCommGetAsyncError, honouring contexts and the communicator's
	// timeout everywhere, communicator creation included. In blocking
	// mode a peer that never arrives at creation blocks NewComm until
	// NCCL's own timeouts.
	Blocking bool
	// CGAClusterSize, MinCTAs, MaxCTAs and NetName: NCCL 2.17.
	CGAClusterSize, MinCTAs, MaxCTAs Value
	NetName                          string
	// SplitShare: NCCL 2.18 (share resources with the parent on split).
	SplitShare Value
	// TrafficClass: NCCL 2.26.
	TrafficClass Value
	// CommName, CollnetEnable, CTAPolicy, ShrinkShare, NVLSCTAs: NCCL 2.27.
	CommName                                        string
	CollnetEnable, CTAPolicy, ShrinkShare, NVLSCTAs Value
	// NChannelsPerNetPeer, NVLinkCentricSched: NCCL 2.28.
	NChannelsPerNetPeer, NVLinkCentricSched Value
	// GraphUsageMode, NumRMACtx: NCCL 2.29.
	GraphUsageMode, NumRMACtx Value
	// MaxP2PPeers: NCCL 2.30.
	MaxP2PPeers Value
	// GraphStreamOrdering: NCCL 2.30.5.
	GraphStreamOrdering Value
}

// ConfigField is one field of ncclConfig_t after the header (size, magic,
// version).
type ConfigField struct {
	Name    string // the C field name
	Offset  int    // byte offset on LP64
	Pointer bool   // const char*; else int
	Since   int    // the NCCL_VERSION code that added it
}

// configFields is ncclConfig_t in order, from nccl.h of each release
// (see the package documentation for the table).
var configFields = []ConfigField{
	{"blocking", 16, false, 21400},
	{"cgaClusterSize", 20, false, 21700},
	{"minCTAs", 24, false, 21700},
	{"maxCTAs", 28, false, 21700},
	{"netName", 32, true, 21700},
	{"splitShare", 40, false, 21800},
	{"trafficClass", 44, false, 22600},
	{"commName", 48, true, 22700},
	{"collnetEnable", 56, false, 22700},
	{"CTAPolicy", 60, false, 22700},
	{"shrinkShare", 64, false, 22700},
	{"nvlsCTAs", 68, false, 22700},
	{"nChannelsPerNetPeer", 72, false, 22800},
	{"nvlinkCentricSched", 76, false, 22800},
	{"graphUsageMode", 80, false, 22900},
	{"numRmaCtx", 84, false, 22900},
	{"maxP2pPeers", 88, false, 23000},
	{"graphStreamOrdering", 92, false, 23005},
}

// ConfigLayout is the ncclConfig_t this package passes to one NCCL
// version: the fields that version has, the size it was compiled with and
// the version code written into the struct.
type ConfigLayout struct {
	// Version is written to ncclConfig_t.version: the loaded NCCL's code,
	// capped at the newest layout this package knows.
	Version int
	// Size is written to ncclConfig_t.size: sizeof the struct in that
	// NCCL's nccl.h (LP64), in bytes.
	Size int
	// Fields are the fields after size, magic and version.
	Fields []ConfigField
}

// LayoutFor returns the ncclConfig_t layout for an NCCL_VERSION code. It
// fails for NCCL older than MinVersion.
func LayoutFor(version int) (ConfigLayout, error) {
	if version < MinVersion {
		return ConfigLayout{}, fmt.Errorf("nccl: %w: NCCL %s is older than %s, which ncclCommInitRankConfig needs",
			comm.ErrUnsupported, VersionString(version), VersionString(MinVersion))
	}
	l := ConfigLayout{Version: min(version, newestLayout)}
	end := 16
	for _, f := range configFields {
		if f.Since > l.Version {
			continue
		}
		l.Fields = append(l.Fields, f)
		if f.Pointer {
			end = f.Offset + 8
		} else {
			end = f.Offset + 4
		}
	}
	l.Size = (end + 7) &^ 7 // size_t and pointers align the struct to 8
	return l, nil
}

// setting is one Config field as the encoder sees it.
type setting struct {
	goName, cName string
	v             Value
	s             string
	ptr           bool
}

func (c *Config) settings() []setting {
	blocking := Int(0)
	if c.Blocking {
		blocking = Int(1)
	}
	return []setting{
		{goName: "Blocking", cName: "blocking", v: blocking},
		{goName: "CGAClusterSize", cName: "cgaClusterSize", v: c.CGAClusterSize},
		{goName: "MinCTAs", cName: "minCTAs", v: c.MinCTAs},
		{goName: "MaxCTAs", cName: "maxCTAs", v: c.MaxCTAs},
		{goName: "NetName", cName: "netName", s: c.NetName, ptr: true},
		{goName: "SplitShare", cName: "splitShare", v: c.SplitShare},
		{goName: "TrafficClass", cName: "trafficClass", v: c.TrafficClass},
		{goName: "CommName", cName: "commName", s: c.CommName, ptr: true},
		{goName: "CollnetEnable", cName: "collnetEnable", v: c.CollnetEnable},
		{goName: "CTAPolicy", cName: "CTAPolicy", v: c.CTAPolicy},
		{goName: "ShrinkShare", cName: "shrinkShare", v: c.ShrinkShare},
		{goName: "NVLSCTAs", cName: "nvlsCTAs", v: c.NVLSCTAs},
		{goName: "NChannelsPerNetPeer", cName: "nChannelsPerNetPeer", v: c.NChannelsPerNetPeer},
		{goName: "NVLinkCentricSched", cName: "nvlinkCentricSched", v: c.NVLinkCentricSched},
		{goName: "GraphUsageMode", cName: "graphUsageMode", v: c.GraphUsageMode},
		{goName: "NumRMACtx", cName: "numRmaCtx", v: c.NumRMACtx},
		{goName: "MaxP2PPeers", cName: "maxP2pPeers", v: c.MaxP2PPeers},
		{goName: "GraphStreamOrdering", cName: "graphStreamOrdering", v: c.GraphStreamOrdering},
	}
}

// encode lays c out as the ncclConfig_t of l: size, magic and version
// set, every field l has either c's value or NCCL_CONFIG_UNDEF_INT/NULL.
// The strings are copied into NUL-terminated memory pinned with pin, whose
// addresses go into the struct; the caller keeps pin until NCCL is done
// with the config. A field set in c that l lacks is an error.
func (l ConfigLayout) encode(c *Config, pin *runtime.Pinner) ([]byte, error) {
	words := make([]uint64, l.Size/8)
	b := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), l.Size)
	le := binary.LittleEndian
	if !littleEndian() {
		return nil, fmt.Errorf("nccl: %w: big-endian host", comm.ErrUnsupported)
	}
	le.PutUint64(b[0:], uint64(l.Size))
	le.PutUint32(b[8:], configMagic)
	le.PutUint32(b[12:], uint32(l.Version))
	offsets := make(map[string]ConfigField, len(l.Fields))
	for _, f := range l.Fields {
		offsets[f.Name] = f
		if f.Pointer {
			le.PutUint64(b[f.Offset:], 0)
		} else {
			le.PutUint32(b[f.Offset:], undefBits)
		}
	}
	var missing []string
	for _, s := range c.settings() {
		f, ok := offsets[s.cName]
		set := s.v.set || (s.ptr && s.s != "")
		if !ok {
			if set && s.goName != "Blocking" {
				missing = append(missing, fmt.Sprintf("Config.%s (ncclConfig_t.%s) needs NCCL %s", s.goName, s.cName, VersionString(sinceOf(s.cName))))
			}
			continue
		}
		switch {
		case s.ptr && s.s != "":
			if strings.IndexByte(s.s, 0) >= 0 {
				return nil, fmt.Errorf("nccl: %w: Config.%s contains a NUL byte", comm.ErrInvalid, s.goName)
			}
			cs := append([]byte(s.s), 0)
			pin.Pin(&cs[0])
			le.PutUint64(b[f.Offset:], uint64(uintptr(unsafe.Pointer(&cs[0]))))
		case s.v.set:
			le.PutUint32(b[f.Offset:], uint32(s.v.v))
		}
	}
	if missing != nil {
		return nil, fmt.Errorf("nccl: %w: the loaded NCCL (config layout %s) lacks %s",
			comm.ErrUnsupported, VersionString(l.Version), strings.Join(missing, "; "))
	}
	return b, nil
}

func sinceOf(cName string) int {
	for _, f := range configFields {
		if f.Name == cName {
			return f.Since
		}
	}
	return 0
}

func littleEndian() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}
