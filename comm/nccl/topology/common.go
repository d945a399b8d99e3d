package topology

import (
	"os"
	"strings"
)

// nvmlPath returns the library NVMLEnv names, or "".
func nvmlPath() string { return strings.TrimSpace(os.Getenv(NVMLEnv)) }

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
