//go:build linux && cgo

package topology

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// NVMLEnv names the environment variable that overrides the NVML library
// Discover loads (default libnvidia-ml.so.1).
const NVMLEnv = "LOOM_NVML"

// Discover reads every GPU NVML sees: name, UUID, PCI bus id, active
// NVLink links and what is at their other end, and the PCIe path between
// every pair (nvmlDeviceGetTopologyCommonAncestor). It fails with an error
// matching ErrUnavailable when NVML cannot be loaded or initialised, and
// wraps NVML's error for a query that fails on a device.
func Discover() (*Topology, error) {
	var opts []nvml.LibraryOption
	if p := nvmlPath(); p != "" {
		opts = append(opts, nvml.WithLibraryPath(p))
	}
	lib := nvml.New(opts...)
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("%w: nvmlInit: %s", ErrUnavailable, errorString(lib, ret))
	}
	// Shutdown only releases NVML; what was read stands whatever it returns.
	defer lib.Shutdown()
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("topology: nvmlDeviceGetCount: %s", errorString(lib, ret))
	}
	t := Uniform(n, "")
	t.Source = "nvml"
	handles := make([]nvml.Device, n)
	for i := range n {
		h, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("topology: nvmlDeviceGetHandleByIndex(%d): %s", i, errorString(lib, ret))
		}
		handles[i] = h
		d := &t.Devices[i]
		d.Index = i
		d.NVLinkPeers = map[string]int{}
		if name, ret := h.GetName(); ret == nvml.SUCCESS {
			d.Name = name
		}
		if uuid, ret := h.GetUUID(); ret == nvml.SUCCESS {
			d.UUID = uuid
		}
		pci, ret := h.GetPciInfo()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("topology: GPU %d: nvmlDeviceGetPciInfo: %s", i, errorString(lib, ret))
		}
		// An id NormalizeBusID cannot parse is kept as NVML wrote it.
		if d.BusID, _ = NormalizeBusID(cString(pci.BusId[:])); d.BusID == "" {
			d.BusID = cString(pci.BusId[:])
		}
		for link := 0; link < nvml.NVLINK_MAX_LINKS; link++ {
			state, ret := h.GetNvLinkState(link)
			if ret != nvml.SUCCESS || state != nvml.FEATURE_ENABLED {
				continue // no such link, NVLink not supported, or down
			}
			remote, ret := h.GetNvLinkRemotePciInfo(link)
			if ret != nvml.SUCCESS {
				continue
			}
			peer, err := NormalizeBusID(cString(remote.BusId[:]))
			if err != nil {
				continue
			}
			d.NVLinkPeers[peer]++
			if kind, ret := h.GetNvLinkRemoteDeviceType(link); ret == nvml.SUCCESS && kind == nvml.NVLINK_DEVICE_TYPE_SWITCH {
				d.SwitchLinks++
			}
		}
	}
	for i := range n {
		for j := i + 1; j < n; j++ {
			l := Link{Path: PathUnknown}
			if level, ret := lib.DeviceGetTopologyCommonAncestor(handles[i], handles[j]); ret == nvml.SUCCESS {
				l.Path = pathOf(level)
			}
			l.NVLinks = nvlinksBetween(&t.Devices[i], &t.Devices[j])
			t.Links[i][j], t.Links[j][i] = l, l
		}
	}
	return t, nil
}

// pathOf maps NVML's topology level to a Path.
func pathOf(level nvml.GpuTopologyLevel) Path {
	switch level {
	case nvml.TOPOLOGY_INTERNAL:
		return PathSame
	case nvml.TOPOLOGY_SINGLE:
		return PathSingle
	case nvml.TOPOLOGY_MULTIPLE:
		return PathMultiple
	case nvml.TOPOLOGY_HOSTBRIDGE:
		return PathHostBridge
	case nvml.TOPOLOGY_NODE:
		return PathNode
	case nvml.TOPOLOGY_SYSTEM:
		return PathSystem
	}
	return PathUnknown
}

func errorString(lib nvml.Interface, ret nvml.Return) string {
	if ret == nvml.ERROR_LIBRARY_NOT_FOUND {
		return "libnvidia-ml.so.1 not found"
	}
	return fmt.Sprintf("%s (%d)", lib.ErrorString(ret), int32(ret))
}

// cString converts a NUL-terminated C char array.
func cString(b []int8) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}
