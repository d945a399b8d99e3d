package safetensors

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
)

// A staging file is where WriteFile writes before renaming over the target.
// Its name is "." + the target's base name + ".tmp-" + a decimal random
// number (the form os.CreateTemp produced in earlier versions, which are
// cleaned up too). Its writer holds an exclusive lock on it (flock) from its
// creation until the rename or its removal; the kernel drops that lock when
// the writer dies, by SIGKILL too. So a staging file of the same target
// that nobody has locked belongs to a writer that died mid-write, and the
// next write removes it (removeStale). On systems without flock nothing is
// locked and nothing is removed.

// maxStagingAttempts bounds the retries of createStaging: after a name
// collision, or when a concurrent cleaner removed the new file before it
// was locked.
const maxStagingAttempts = 10

// stagingPrefix is the start of every staging file name of target base.
func stagingPrefix(base string) string { return "." + base + ".tmp-" }

// isStagingName reports whether name is a staging file name of the target
// whose prefix is prefix.
func isStagingName(name, prefix string) bool {
	if len(name) <= len(prefix) || name[:len(prefix)] != prefix {
		return false
	}
	digits := name[len(prefix):]
	if len(digits) > 20 { // a uint64 has at most 20 digits
		return false
	}
	for i := 0; i < len(digits); i++ {
		if digits[i] < '0' || digits[i] > '9' {
			return false
		}
	}
	return true
}

// createStaging creates a new staging file for base in dir, mode 0600, and
// holds its lock.
func createStaging(dir, base string) (*os.File, error) {
	for range maxStagingAttempts {
		name := filepath.Join(dir, stagingPrefix(base)+strconv.FormatUint(rand.Uint64(), 10))
		f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if err := lockFile(f, true); err != nil {
			// Tidying: the lock's failure is what to report.
			_ = f.Close()
			_ = os.Remove(name)
			return nil, fmt.Errorf("locking the staging file: %w", err)
		}
		// A concurrent writer's removeStale may have locked and removed
		// the file between its creation and the lock above; then the name
		// no longer leads to it and this writer starts again.
		same, err := namesFile(name, f)
		if err != nil {
			// The Stat's error is what to report; the file, unlocked by
			// the Close, is left to the next write's removeStale.
			_ = f.Close()
			return nil, err
		}
		if same {
			return f, nil
		}
		_ = f.Close() // the file is already gone: nothing to tidy
	}
	return nil, fmt.Errorf("no staging file for %s in %s after %d attempts", base, dir, maxStagingAttempts)
}

// namesFile reports whether path still names the open file f. A missing
// path is not an error.
func namesFile(path string, f *os.File) (bool, error) {
	st, err := f.Stat()
	if err != nil {
		return false, err
	}
	lst, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return os.SameFile(st, lst), nil
}

// removeStale removes the staging files of target base in dir that no
// writer holds, except own. It is best effort: a write must not fail
// because an abandoned file could not be tidied, so errors are ignored.
func removeStale(dir, base, own string) {
	if !canLock {
		return
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	prefix := stagingPrefix(base)
	for _, e := range entries {
		name := e.Name()
		if name == own || !e.Type().IsRegular() || !isStagingName(name, prefix) {
			continue
		}
		path := filepath.Join(dir, name)
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		// Locked: its writer is alive. Otherwise remove it while holding
		// the lock, so that no writer can take it up meanwhile, and only
		// if the name still leads to the file that was locked.
		if lockFile(f, false) == nil {
			if same, err := namesFile(path, f); err == nil && same {
				_ = os.Remove(path) // best effort, see above
			}
		}
		_ = f.Close() // read only: closing loses nothing
	}
}
