package cuda

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// KernelCacheEnv names the environment variable that sets the folder of
// the on-disk kernel cache: a path, or "off" to compile every program.
// [WithKernelCache] takes precedence; without either the cache is
// os.UserCacheDir()/loom/kernels (on Linux $XDG_CACHE_HOME/loom/kernels or
// ~/.cache/loom/kernels), the folder of loom's cost model too.
const KernelCacheEnv = "LOOM_KERNEL_CACHE"

// WithKernelCache sets the folder of the on-disk kernel cache, overriding
// [KernelCacheEnv]: a path, [Off] to compile every program, or "" for the
// default (see [KernelCacheEnv]).
func WithKernelCache(dir string) Option {
	return func(c *loadConfig) { c.cache, c.cacheSet = dir, true }
}

// kernelCacheDir resolves the cache folder: the option's, else the
// environment's, else the user cache folder's loom/kernels; "" when the
// cache is off or the user has no cache folder.
func kernelCacheDir(c loadConfig, getenv func(string) string, userCacheDir func() (string, error)) string {
	spec := c.cache
	if !c.cacheSet {
		spec = getenv(KernelCacheEnv)
	}
	switch spec {
	case Off:
		return ""
	case "":
		dir, err := userCacheDir()
		if err != nil {
			return "" // no home to cache in: compile every time
		}
		return filepath.Join(dir, "loom", "kernels")
	}
	return spec
}

// KernelCache returns the folder of the on-disk kernel cache, or "" when
// it is off.
func (l *Lib) KernelCache() string { return l.cacheDir }

// cacheKey is the hex SHA-256 naming a compiled program in the cache:
// over the source, the NVRTC options, the target (architecture, and
// whether PTX) and NVRTC's version, so that a change to any of them
// compiles anew.
func cacheKey(src string, opts []string, arch int, ptx bool, major, minor int) string {
	h := sha256.New()
	target := "sm_" + strconv.Itoa(arch)
	if ptx {
		target += "+ptx"
	}
	_, _ = io.WriteString(h, "loom-kernel-cache/1\x00"+src+"\x00"+strings.Join(opts, "\x00")+"\x00"+target+
		"\x00nvrtc "+strconv.Itoa(major)+"."+strconv.Itoa(minor)) // a hash.Hash never fails to write
	return hex.EncodeToString(h.Sum(nil))
}

// cachePath is the file of key's program in dir: <key>.cubin or
// <key>.ptx.
func cachePath(dir, key string, ptx bool) string {
	if ptx {
		return filepath.Join(dir, key+".ptx")
	}
	return filepath.Join(dir, key+".cubin")
}

// readCache returns the image stored in file, or nil when there is none.
// A file is the SHA-256 of the image followed by the image; one whose
// digest does not match (a torn or corrupted write) is deleted, so that
// the program is compiled and stored again.
func readCache(file string) []byte {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil // missing or unreadable: a miss either way
	}
	if len(b) > sha256.Size {
		sum := sha256.Sum256(b[sha256.Size:])
		if bytes.Equal(sum[:], b[:sha256.Size]) {
			return b[sha256.Size:]
		}
	}
	_ = os.Remove(file) // corrupt; a failed removal is overwritten by the next store
	return nil
}

// writeCache stores image in file (in dir, made if missing) as its
// SHA-256 and the image, written to a temporary file and renamed into
// place, so that a reader never sees a partial file and ranks that store
// the same program at once only replace one copy by another.
func writeCache(dir, file string, image []byte) (err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("cuda: kernel cache: %w", err)
	}
	tmp, err := os.CreateTemp(dir, filepath.Base(file)+".tmp*")
	if err != nil {
		return fmt.Errorf("cuda: kernel cache: %w", err)
	}
	defer func() {
		if err != nil {
			_ = os.Remove(tmp.Name()) // cleanup; err is the one to report
		}
	}()
	sum := sha256.Sum256(image)
	_, werr := tmp.Write(append(sum[:], image...))
	if err := errors.Join(werr, tmp.Close()); err != nil {
		return fmt.Errorf("cuda: kernel cache: writing %s: %w", tmp.Name(), err)
	}
	if err := os.Rename(tmp.Name(), file); err != nil {
		return fmt.Errorf("cuda: kernel cache: %w", err)
	}
	return nil
}
