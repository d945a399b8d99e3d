package checkpoint

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// event is one file operation, reported to a hook before it happens.
type event struct {
	Op   string // "mkdir", "create", "write", "writeback", "fsync", "rename", "remove", "read"
	Rank int    // the world rank doing it
	Path string // the file or folder (for a rename, the old name)
	Off  int64  // write, writeback and read: the byte offset
	N    int64  // write, writeback and read: the byte count
}

// files does a rank's file operations, reporting each to the hook.
type files struct {
	rank int
	hook func(event)
}

func (f files) at(ev event) {
	if f.hook != nil {
		ev.Rank = f.rank
		f.hook(ev)
	}
}

func (f files) mkdir(path string) error {
	f.at(event{Op: "mkdir", Path: path})
	return os.Mkdir(path, 0o755)
}

func (f files) create(path string) (*os.File, error) {
	f.at(event{Op: "create", Path: path})
	return os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
}

func (f files) write(w *os.File, off int64, b []byte) error {
	f.at(event{Op: "write", Path: w.Name(), Off: off, N: int64(len(b))})
	_, err := w.Write(b)
	return err
}

// writeback starts writing w's bytes [off, off+n) to the disk without
// waiting (startWriteback). It is a hint, so its error is dropped: the
// fsync that makes the file durable reports what went wrong.
func (f files) writeback(w *os.File, off, n int64) {
	f.at(event{Op: "writeback", Path: w.Name(), Off: off, N: n})
	_ = startWriteback(w, off, n)
}

func (f files) fsync(w *os.File) error {
	f.at(event{Op: "fsync", Path: w.Name()})
	return w.Sync()
}

// fsyncDir makes the renames in dir durable.
func (f files) fsyncDir(dir string) error {
	f.at(event{Op: "fsync", Path: dir})
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close() // read only: closing loses nothing
	if err := d.Sync(); err != nil && !isUnsupportedSync(err) {
		return err
	}
	return nil
}

// isUnsupportedSync reports a file system that cannot sync a folder
// (EINVAL on some), where the rename's durability is the system's.
func isUnsupportedSync(err error) bool {
	return err == syscall.EINVAL || strings.Contains(err.Error(), "invalid argument")
}

func (f files) rename(from, to string) error {
	f.at(event{Op: "rename", Path: from})
	return os.Rename(from, to)
}

func (f files) removeAll(path string) error {
	f.at(event{Op: "remove", Path: path})
	return os.RemoveAll(path)
}

func (f files) read(r *os.File, off int64, b []byte) error {
	f.at(event{Op: "read", Path: r.Name(), Off: off, N: int64(len(b))})
	_, err := r.ReadAt(b, off)
	return err
}

// writeFile writes data to path through a staging name, fsyncs it and
// renames it into place; the caller fsyncs the folder.
func (f files) writeFile(path string, data []byte) error {
	tmp := path + ".tmp"
	w, err := f.create(tmp)
	if err != nil {
		return err
	}
	if err := f.write(w, 0, data); err != nil {
		_ = w.Close() // the write's error is what to report
		return err
	}
	if err := f.fsync(w); err != nil {
		_ = w.Close()
		return err
	}
	if err := w.Close(); err != nil {
		return err
	}
	return f.rename(tmp, path)
}

// lockName is the lock file in a checkpoint folder.
const lockName = ".lock"

// lock is a held checkpoint-folder lock: an exclusive flock(2) on
// root/.lock, which the kernel releases when the holder's process ends,
// however it ends, so a killed save never leaves the folder locked.
type lock struct{ f *os.File }

// acquire takes the folder's lock without waiting. When another writer
// holds it the error wraps ErrLocked and names the holder as it wrote
// itself into the lock file.
func acquire(op, root string, step int) (*lock, error) {
	path := filepath.Join(root, lockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, wrapf(op, err, "opening the lock file")
	}
	if err := flock(f); err != nil {
		holder, _ := os.ReadFile(path) // best effort: the holder's own words
		_ = f.Close()
		if err == syscall.EWOULDBLOCK {
			h := strings.TrimSpace(string(holder))
			if h == "" {
				h = "a writer that has not yet named itself"
			}
			return nil, fmt.Errorf("checkpoint: %s: %w: %s is held by %s", op, ErrLocked, root, h)
		}
		return nil, wrapf(op, err, "locking %s", path)
	}
	host, _ := os.Hostname() // the name only helps a person find the holder
	who := fmt.Sprintf("pid %d on %s, saving step %d since %s\n", os.Getpid(), host, step, time.Now().UTC().Format(time.RFC3339))
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(who), 0) // naming the holder is a courtesy, not the lock
	}
	return &lock{f: f}, nil
}

// release drops the lock (the file stays: removing a lock file races
// with a writer that has just opened it).
func (l *lock) release() {
	_ = l.f.Close() // closing releases the flock; nothing written can be lost
}

// stepName is the folder of a complete checkpoint of step.
func stepName(step int) string { return fmt.Sprintf("step-%010d", step) }

// parseStep returns the step of a complete checkpoint's folder name.
func parseStep(name string) (int, bool) {
	digits, ok := strings.CutPrefix(name, "step-")
	if !ok || len(digits) != 10 {
		return 0, false
	}
	n := 0
	for _, c := range digits {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}

// stagingPrefix starts the name of a checkpoint being written, trashPrefix
// that of one being deleted; neither is ever taken for a checkpoint.
const (
	stagingPrefix = ".staging-"
	trashPrefix   = ".trash-"
)

// committed lists the steps of root's complete checkpoints (a step folder
// holding a manifest), oldest first.
func committed(root string) ([]int, error) {
	ents, err := os.ReadDir(root)
	if err != nil {
		return nil, err
	}
	var steps []int
	for _, e := range ents {
		step, ok := parseStep(e.Name())
		if !ok || !e.IsDir() {
			continue
		}
		if _, err := os.Stat(filepath.Join(root, e.Name(), manifestName)); err == nil {
			steps = append(steps, step) // ReadDir sorts by name: ascending steps
		} else if !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
	}
	return steps, nil
}

// Latest returns the path of the newest complete checkpoint in root: the
// step folder with the highest step that holds a manifest. A save in
// progress or killed is never one (its folder has a staging name until
// its manifest is in place). Load checks the manifest and the data. The
// error wraps ErrNotFound when there is none.
func Latest(root string) (string, error) {
	steps, err := committed(root)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("checkpoint: Latest: %w in %s: the folder does not exist", ErrNotFound, root)
		}
		return "", wrapf("Latest", err, "listing %s", root)
	}
	if len(steps) == 0 {
		return "", fmt.Errorf("checkpoint: Latest: %w in %s", ErrNotFound, root)
	}
	return filepath.Join(root, stepName(steps[len(steps)-1])), nil
}
