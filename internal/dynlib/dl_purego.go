//go:build linux && (amd64 || arm64)

package dynlib

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/ebitengine/purego"
)

// Supported reports whether this platform can load libraries.
const Supported = true

func dlopen(name string) (uintptr, error) {
	return purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL)
}

func dlsym(h uintptr, name string) (uintptr, bool) {
	addr, err := purego.Dlsym(h, name)
	return addr, err == nil && addr != 0
}

func dlclose(h uintptr) error { return purego.Dlclose(h) }

func registerFunc(fn any, addr uintptr) { purego.RegisterFunc(fn, addr) }

// mappedFile finds the file mapped at addr in /proc/self/maps; "" when it
// cannot.
func mappedFile(addr uintptr) string {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// start-end perms offset dev inode path
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 {
			continue
		}
		lo, hi, ok := strings.Cut(fields[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || uint64(addr) < start || uint64(addr) >= end {
			continue
		}
		if p := strings.Join(fields[5:], " "); filepath.IsAbs(p) {
			return p
		}
		return ""
	}
	return ""
}
