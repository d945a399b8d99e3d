package cuda

import (
	"crypto/sha256"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
)

// TestCacheKey: the key changes with each of source, options,
// architecture, PTX and NVRTC version, and with nothing else.
func TestCacheKey(t *testing.T) {
	base := cacheKey("src", []string{"-a", "-b"}, 90, false, 12, 4)
	if len(base) != 2*sha256.Size {
		t.Fatalf("key %q is not a hex SHA-256", base)
	}
	if again := cacheKey("src", []string{"-a", "-b"}, 90, false, 12, 4); again != base {
		t.Error("the same inputs give another key")
	}
	for _, c := range []struct {
		name string
		key  string
	}{
		{"source", cacheKey("src2", []string{"-a", "-b"}, 90, false, 12, 4)},
		{"options", cacheKey("src", []string{"-a", "-c"}, 90, false, 12, 4)},
		{"option order", cacheKey("src", []string{"-b", "-a"}, 90, false, 12, 4)},
		{"options joined differently", cacheKey("src", []string{"-a-b"}, 90, false, 12, 4)},
		{"architecture", cacheKey("src", []string{"-a", "-b"}, 80, false, 12, 4)},
		{"PTX", cacheKey("src", []string{"-a", "-b"}, 90, true, 12, 4)},
		{"NVRTC major", cacheKey("src", []string{"-a", "-b"}, 90, false, 13, 4)},
		{"NVRTC minor", cacheKey("src", []string{"-a", "-b"}, 90, false, 12, 6)},
	} {
		if c.key == base {
			t.Errorf("changing the %s keeps the key", c.name)
		}
	}
	if cachePath("/d", "k", false) != "/d/k.cubin" || cachePath("/d", "k", true) != "/d/k.ptx" {
		t.Error("cachePath")
	}
}

// TestKernelCacheDir: the option wins over the environment, which wins
// over the user cache folder; "off" disables, and so does having no user
// cache folder.
func TestKernelCacheDir(t *testing.T) {
	user := func() (string, error) { return "/home/u/.cache", nil }
	noUser := func() (string, error) { return "", errors.New("no $HOME") }
	for _, c := range []struct {
		name string
		cfg  loadConfig
		env  string
		user func() (string, error)
		want string
	}{
		{"default", loadConfig{}, "", user, "/home/u/.cache/loom/kernels"},
		{"environment", loadConfig{}, "/env/dir", user, "/env/dir"},
		{"environment off", loadConfig{}, Off, user, ""},
		{"option over environment", loadConfig{cache: "/opt/dir", cacheSet: true}, "/env/dir", user, "/opt/dir"},
		{"option off", loadConfig{cache: Off, cacheSet: true}, "/env/dir", user, ""},
		{"option empty is the default", loadConfig{cache: "", cacheSet: true}, "/env/dir", user, "/home/u/.cache/loom/kernels"},
		{"no user cache folder", loadConfig{}, "", noUser, ""},
	} {
		getenv := func(k string) string {
			if k == KernelCacheEnv {
				return c.env
			}
			return ""
		}
		if got := kernelCacheDir(c.cfg, getenv, c.user); got != c.want {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
}

// TestCacheFiles: a stored image reads back; a file whose digest does not
// match, or too short to hold one, reads as a miss and is deleted.
func TestCacheFiles(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "made", "here")
	file := filepath.Join(dir, "k.cubin")
	if readCache(file) != nil {
		t.Fatal("a missing file read as a hit")
	}
	img := []byte("FAKE sm_90")
	must(t, writeCache(dir, file, img))
	if got := readCache(file); string(got) != string(img) {
		t.Fatalf("readCache = %q, want %q", got, img)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("%d files in the cache folder, want 1 (no temporary left)", len(ents))
	}
	raw, err := os.ReadFile(file)
	must(t, err)
	for _, c := range []struct {
		name string
		data []byte
	}{
		{"flipped payload byte", append(raw[:len(raw)-1:len(raw)-1], raw[len(raw)-1]^1)},
		{"flipped digest byte", append([]byte{raw[0] ^ 1}, raw[1:]...)},
		{"truncated to the digest", raw[:sha256.Size]},
		{"short", raw[:5]},
		{"empty", nil},
	} {
		must(t, os.WriteFile(file, c.data, 0o644))
		if got := readCache(file); got != nil {
			t.Errorf("%s: read as %q", c.name, got)
		}
		if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: the corrupt file was not deleted (%v)", c.name, err)
		}
	}
	// A folder that cannot be made is an error for the caller to report.
	blocker := filepath.Join(t.TempDir(), "file")
	must(t, os.WriteFile(blocker, nil, 0o644))
	if err := writeCache(blocker, filepath.Join(blocker, "k.cubin"), img); err == nil {
		t.Error("writing under a regular file: no error")
	}
}

// TestCacheConcurrentStores: ranks storing the same program while others
// read it never show a reader a partial file (each store is a rename of a
// complete temporary file), and leave no temporary behind.
func TestCacheConcurrentStores(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "k.cubin")
	img := make([]byte, 64<<10)
	for i := range img {
		img[i] = byte(i * 7)
	}
	must(t, writeCache(dir, file, img))
	var wg sync.WaitGroup
	var misses, errs atomic.Int64
	for range 4 {
		wg.Go(func() {
			for range 100 {
				if err := writeCache(dir, file, img); err != nil {
					errs.Add(1)
				}
			}
		})
		wg.Go(func() {
			for range 100 {
				if got := readCache(file); len(got) != len(img) {
					misses.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if misses.Load() != 0 || errs.Load() != 0 {
		t.Errorf("%d reads missed and %d stores failed while stores ran", misses.Load(), errs.Load())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("%d files in the cache folder, want 1", len(ents))
	}
}
