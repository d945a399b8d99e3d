package checkpoint

import (
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
)

// Option configures Save or Load. Each option says which call takes it;
// giving Load a Save option (or the reverse) is an error wrapping
// ErrInvalid, so a misplaced option is never silently ignored.
type Option func(*config)

// use says which calls an option belongs to.
type use uint8

const (
	forSave use = 1 << iota
	forLoad
	forFill  // LoadInto
	forSaver // NewSaver and Saver.Save only
	forExport
	forImport
)

type config struct {
	step     int
	hasStep  bool
	keep     int
	block    int
	memLimit int
	prefix   string
	reshape  bool
	world    comm.Communicator
	dev      device.Device
	hook     func(event)
	errs     []error
	uses     []struct {
		name string
		use  use
	}
}

func (c *config) note(name string, u use) {
	c.uses = append(c.uses, struct {
		name string
		use  use
	}{name, u})
}

// defaultBlock is the default checksum block: one CRC-32C per MiB of
// chunk data, so a reader that needs a few rows of a large chunk reads
// at most a MiB around each run to verify it, and the manifest holds 4
// bytes of checksum per MiB saved.
const defaultBlock = 1 << 20

// WithStep names the checkpoint by a training step (folder
// "step-0000000042"); every rank must pass the same step (Save). Without
// it Save takes the step after the newest checkpoint in the folder (0 in
// an empty one). A step that already has a complete checkpoint is refused.
func WithStep(step int) Option {
	return func(c *config) {
		c.note("WithStep", forSave)
		if err := numcheck.NonNegativeCount(ErrInvalid, "step", step); err != nil {
			c.errs = append(c.errs, err)
		}
		c.step, c.hasStep = step, true
	}
}

// WithKeep keeps the newest k complete checkpoints of the folder, the new
// one included, and deletes older ones after the new one is complete
// (Save). 0, the default, keeps every checkpoint.
func WithKeep(k int) Option {
	return func(c *config) {
		c.note("WithKeep", forSave)
		if err := numcheck.NonNegativeCount(ErrInvalid, "keep", k); err != nil {
			c.errs = append(c.errs, err)
		}
		c.keep = k
	}
}

// WithBlockSize sets the checksum block in bytes (Save): each chunk's data
// is checksummed in blocks of this many bytes (the last may be short), and
// a reader reads and verifies whole blocks around the bytes it needs.
// Smaller blocks make partial reads tighter and the manifest larger. The
// default is 1 MiB.
func WithBlockSize(bytes int) Option {
	return func(c *config) {
		c.note("WithBlockSize", forSave)
		if err := numcheck.Count(ErrInvalid, "block size", bytes); err != nil {
			c.errs = append(c.errs, err)
		}
		c.block = bytes
	}
}

// WithComm gives the communicator of the job's ranks, every one of which
// calls Save (or Load, LoadInto). Without it the world communicator of the tensors'
// mesh is used (mesh.Mesh.World); a rank that saves no tensors, or loads
// none, needs it.
func WithComm(c comm.Communicator) Option {
	return func(cfg *config) {
		cfg.note("WithComm", forSave|forLoad|forFill|forExport)
		cfg.world = c
	}
}

// WithDevice places the loaded tensors' local blocks on d (Load); nil, the
// default, is the host. The data is read into host memory and copied to
// the device tensor by tensor.
func WithDevice(d device.Device) Option {
	return func(c *config) {
		c.note("WithDevice", forLoad)
		c.dev = d
	}
}

// withHook calls h before every file operation of the call (create,
// write, fsync, rename, remove, read): tests record the byte ranges each
// rank touches and kill the process at each point in turn.
func withHook(h func(event)) Option {
	return func(c *config) {
		c.note("withHook", forSave|forLoad|forFill|forExport)
		c.hook = h
	}
}

// newConfig applies opts for the call op, which takes the options of u.
func newConfig(op string, u use, opts []Option) (*config, error) {
	c := &config{block: defaultBlock}
	for i, o := range opts {
		if o == nil {
			return nil, invalidf(op, "option %d is nil", i)
		}
		o(c)
	}
	for _, n := range c.uses {
		if n.use&u == 0 {
			return nil, invalidf(op, "%s is not an option of %s", n.name, op)
		}
	}
	if len(c.errs) > 0 {
		return nil, invalidf(op, "%v", c.errs[0])
	}
	return c, nil
}
