package topology

import (
	"fmt"
	"unsafe"

	"github.com/b7ea7098/loom/internal/dynlib"
)

// NVMLEnv names the environment variable that chooses the NVML library
// Discover loads: a soname or path, or "off" for none (Discover then fails
// with ErrUnavailable and Detect falls back to Uniform). By default
// libnvidia-ml.so.1, then libnvidia-ml.so.
const NVMLEnv = "LOOM_NVML"

// NVML's constants that Discover uses (nvml.h).
const (
	nvmlSuccess            = 0
	nvmlFeatureEnabled     = 1
	nvmlDeviceTypeSwitch   = 2
	nvmlNVLinkMaxLinks     = 36 // NVML_NVLINK_MAX_LINKS; a driver with fewer answers an error past its own, and those links are skipped
	nvmlNameBufferSize     = 96 // NVML_DEVICE_NAME_V2_BUFFER_SIZE
	nvmlUUIDBufferSize     = 96 // NVML_DEVICE_UUID_V2_BUFFER_SIZE
	nvmlTopologyInternal   = 0
	nvmlTopologySingle     = 10
	nvmlTopologyMultiple   = 20
	nvmlTopologyHostBridge = 30
	nvmlTopologyNode       = 40
	nvmlTopologySystem     = 50
)

// pciInfo is nvmlPciInfo_t (the layout of nvmlDeviceGetPciInfo_v3 and
// nvmlDeviceGetNvLinkRemotePciInfo_v2): 68 bytes, 4-byte aligned.
type pciInfo struct {
	_     [16]byte  // busIdLegacy
	_     [5]uint32 // domain, bus, device, pciDeviceId, pciSubSystemId
	busID [32]byte
}

// nvmlFns are the NVML entry points Discover calls, bound at run time
// through purego like every other GPU library of loom, so that neither a C
// compiler nor cgo is needed to build a program that reads the topology.
// nvmlDevice_t is an opaque pointer, held as a uintptr; NVML keeps the
// devices alive until nvmlShutdown, and Go never dereferences them.
type nvmlFns struct {
	init            func() int32
	shutdown        func() int32
	errorString     func(ret int32) string
	count           func(n *uint32) int32
	handleByIndex   func(i uint32, dev *uintptr) int32
	name            func(dev uintptr, buf *byte, n uint32) int32
	uuid            func(dev uintptr, buf *byte, n uint32) int32
	pciInfo         func(dev uintptr, pci *pciInfo) int32
	commonAncestor  func(a, b uintptr, level *int32) int32
	nvlinkState     func(dev uintptr, link uint32, state *int32) int32
	nvlinkRemotePCI func(dev uintptr, link uint32, pci *pciInfo) int32
	nvlinkRemoteTyp func(dev uintptr, link uint32, kind *int32) int32
}

// symbols lists the entry points to bind into f. The NVLink queries are
// optional (a driver without them has no NVLink to report), as is the
// remote device type (added after the others: without it no link counts
// as a switch link).
func (f *nvmlFns) symbols() []dynlib.Symbol {
	return []dynlib.Symbol{
		{Name: "nvmlInit_v2", Fn: &f.init},
		{Name: "nvmlShutdown", Fn: &f.shutdown},
		{Name: "nvmlErrorString", Fn: &f.errorString},
		{Name: "nvmlDeviceGetCount_v2", Fn: &f.count},
		{Name: "nvmlDeviceGetHandleByIndex_v2", Fn: &f.handleByIndex},
		{Name: "nvmlDeviceGetName", Fn: &f.name},
		{Name: "nvmlDeviceGetUUID", Fn: &f.uuid},
		{Name: "nvmlDeviceGetPciInfo_v3", Fn: &f.pciInfo},
		{Name: "nvmlDeviceGetTopologyCommonAncestor", Fn: &f.commonAncestor},
		{Name: "nvmlDeviceGetNvLinkState", Fn: &f.nvlinkState, Optional: true},
		{Name: "nvmlDeviceGetNvLinkRemotePciInfo_v2", Fn: &f.nvlinkRemotePCI, Optional: true},
		{Name: "nvmlDeviceGetNvLinkRemoteDeviceType", Fn: &f.nvlinkRemoteTyp, Optional: true},
	}
}

// loadNVML dlopens NVML as NVMLEnv asks and binds its entry points. The
// library is never closed: NVML may keep threads of its own, and a second
// dlopen of it returns the same handle.
func loadNVML() (*nvmlFns, error) {
	spec := dynlib.SpecFrom("", false, NVMLEnv)
	f, _, _, err := dynlib.First(spec.Search("nvml", "libnvidia-ml.so.1", "libnvidia-ml.so"), dynlib.BindNew((*nvmlFns).symbols))
	if err != nil {
		return nil, fmt.Errorf("%w (%s): %v", ErrUnavailable, NVMLEnv, err)
	}
	return f, nil
}

// Discover reads every GPU NVML sees: name, UUID, PCI bus id, active
// NVLink links and what is at their other end, and the PCIe path between
// every pair (nvmlDeviceGetTopologyCommonAncestor). NVML is loaded at run
// time (NVMLEnv); Discover fails with an error matching ErrUnavailable
// when it cannot be loaded or initialised, and with NVML's error naming
// the query and the GPU when a query fails on a device.
func Discover() (*Topology, error) {
	f, err := loadNVML()
	if err != nil {
		return nil, err
	}
	if ret := f.init(); ret != nvmlSuccess {
		return nil, fmt.Errorf("%w: nvmlInit: %s", ErrUnavailable, f.errString(ret))
	}
	// Shutdown only releases NVML; what was read stands whatever it returns.
	defer f.shutdown()
	var n uint32
	if ret := f.count(&n); ret != nvmlSuccess {
		return nil, fmt.Errorf("topology: nvmlDeviceGetCount: %s", f.errString(ret))
	}
	t := Uniform(int(n), "")
	t.Source = "nvml"
	handles := make([]uintptr, n)
	for i := range int(n) {
		if ret := f.handleByIndex(uint32(i), &handles[i]); ret != nvmlSuccess {
			return nil, fmt.Errorf("topology: nvmlDeviceGetHandleByIndex(%d): %s", i, f.errString(ret))
		}
		h := handles[i]
		d := &t.Devices[i]
		d.Index = i
		d.NVLinkPeers = map[string]int{}
		var name [nvmlNameBufferSize]byte
		if f.name(h, &name[0], uint32(len(name))) == nvmlSuccess {
			d.Name = cString(name[:])
		}
		var uuid [nvmlUUIDBufferSize]byte
		if f.uuid(h, &uuid[0], uint32(len(uuid))) == nvmlSuccess {
			d.UUID = cString(uuid[:])
		}
		var pci pciInfo
		if ret := f.pciInfo(h, &pci); ret != nvmlSuccess {
			return nil, fmt.Errorf("topology: GPU %d: nvmlDeviceGetPciInfo: %s", i, f.errString(ret))
		}
		// An id NormalizeBusID cannot parse is kept as NVML wrote it.
		if d.BusID, _ = NormalizeBusID(cString(pci.busID[:])); d.BusID == "" {
			d.BusID = cString(pci.busID[:])
		}
		f.readNVLinks(h, d)
	}
	for i := range int(n) {
		for j := i + 1; j < int(n); j++ {
			l := Link{Path: PathUnknown}
			var level int32
			if f.commonAncestor(handles[i], handles[j], &level) == nvmlSuccess {
				l.Path = pathOf(level)
			}
			l.NVLinks = nvlinksBetween(&t.Devices[i], &t.Devices[j])
			t.Links[i][j], t.Links[j][i] = l, l
		}
	}
	return t, nil
}

// readNVLinks records the active NVLink links of device h in d: what is at
// each one's other end, and how many end at an NVSwitch. A link that is
// absent, down or not supported, or whose other end NVML cannot name, is
// skipped.
func (f *nvmlFns) readNVLinks(h uintptr, d *Device) {
	if f.nvlinkState == nil || f.nvlinkRemotePCI == nil {
		return
	}
	for link := range uint32(nvmlNVLinkMaxLinks) {
		var state int32
		if f.nvlinkState(h, link, &state) != nvmlSuccess || state != nvmlFeatureEnabled {
			continue
		}
		var remote pciInfo
		if f.nvlinkRemotePCI(h, link, &remote) != nvmlSuccess {
			continue
		}
		peer, err := NormalizeBusID(cString(remote.busID[:]))
		if err != nil {
			continue
		}
		d.NVLinkPeers[peer]++
		var kind int32
		if f.nvlinkRemoteTyp != nil && f.nvlinkRemoteTyp(h, link, &kind) == nvmlSuccess && kind == nvmlDeviceTypeSwitch {
			d.SwitchLinks++
		}
	}
}

// errString is NVML's text for ret, with its number.
func (f *nvmlFns) errString(ret int32) string {
	return fmt.Sprintf("%s (%d)", f.errorString(ret), ret)
}

// pathOf maps NVML's topology level to a Path.
func pathOf(level int32) Path {
	switch level {
	case nvmlTopologyInternal:
		return PathSame
	case nvmlTopologySingle:
		return PathSingle
	case nvmlTopologyMultiple:
		return PathMultiple
	case nvmlTopologyHostBridge:
		return PathHostBridge
	case nvmlTopologyNode:
		return PathNode
	case nvmlTopologySystem:
		return PathSystem
	}
	return PathUnknown
}

// cString converts a NUL-terminated C char array.
func cString(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// nvlinksBetween counts the NVLink links between two GPUs: direct links
// from a to b (NVML reports each link on both ends; a's count is used),
// or, when both have links to NVSwitches, the smaller of their switch
// link counts (an NVSwitch fabric connects every pair at the bandwidth of
// the fewer links).
func nvlinksBetween(a, b *Device) int {
	if k := a.NVLinkPeers[b.BusID]; k > 0 {
		return k
	}
	if a.SwitchLinks > 0 && b.SwitchLinks > 0 {
		return min(a.SwitchLinks, b.SwitchLinks)
	}
	return 0
}

// The layout pciInfo must have; a change to it fails the build.
var _ [68]byte = [unsafe.Sizeof(pciInfo{})]byte{}
