package cuda

import (
	"errors"
	"fmt"
	"sync"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
)

// targetSlots is how many target checks of CrossEntropy and its backward
// the device holds unread; a call that finds them all in use reads them
// first (it waits for the device).
const targetSlots = 64

// noBadRow is a slot's value when its check found no target out of range
// (loom_xent_targets keeps the least bad row by an unsigned atomicMin).
const noBadRow = ^uint64(0)

// targetCheck is one queued check: the method and its number of classes.
type targetCheck struct {
	op string
	v  int
}

// targetChecks are the device's pending target checks: the CPU kernels
// reject a target outside [0, v), which on the device only loom_xent_targets
// sees, so each call writes the least bad row into a slot of a small device
// buffer that Synchronize and CopyToHost read after their wait.
type targetChecks struct {
	mu      sync.Mutex
	slots   *DeviceBuffer // Int64, targetSlots; noBadRow when clean
	pending []targetCheck // slot i holds pending[i]'s result
}

// checkTargets queues loom_xent_targets over rows targets of v classes for
// op. Errors of earlier calls it had to read to free the slots are
// returned with its own.
func (k cudaKernels) checkTargets(op string, targets *DeviceBuffer, rows, v int) error {
	if rows == 0 {
		return nil
	}
	t := &k.d.targets
	t.mu.Lock()
	defer t.mu.Unlock()
	var earlier error
	if t.slots == nil {
		b, err := k.scratch(comm.Int64, targetSlots)
		if err != nil {
			return fmt.Errorf("%s: %s: the target check's slots: %w", k.d.name, op, err)
		}
		if err := k.elementwise(op, "convert.cu", "loom_fill_u64", targetSlots, b.raw(), noBadRow, int64(targetSlots)); err != nil {
			return errors.Join(err, b.free())
		}
		t.slots = b
	} else if len(t.pending) == targetSlots {
		earlier = k.d.readTargetsLocked()
	}
	slot := Buffer{Ptr: DevicePtr(t.slots.ptr + uintptr(8*len(t.pending))), Bytes: 8}
	if err := k.elementwise(op, "xent.cu", "loom_xent_targets", rows, slot, targets.raw(), int64(rows), int64(v)); err != nil {
		return errors.Join(earlier, err)
	}
	t.pending = append(t.pending, targetCheck{op: op, v: v})
	return earlier
}

// readTargets waits for the compute stream and returns the errors of the
// target checks queued since the last read, each once.
func (d *Device) readTargets() error {
	d.targets.mu.Lock()
	defer d.targets.mu.Unlock()
	return d.readTargetsLocked()
}

// readTargetsLocked is readTargets with d.targets.mu held. The slots read
// are set back to noBadRow on the compute stream.
func (d *Device) readTargetsLocked() error {
	t := &d.targets
	n := len(t.pending)
	if n == 0 {
		return nil
	}
	rows := make([]uint64, n)
	if err := CopyFromDeviceAsync(d.compute, rows, t.slots.raw()); err != nil {
		return fmt.Errorf("%s: reading the target checks: %w", d.name, err)
	}
	var errs []error
	for i, r := range rows {
		if r != noBadRow {
			c := t.pending[i]
			errs = append(errs, fmt.Errorf("%s: %s: %w: the target of row %d is outside [0, %d)", d.name, c.op, device.ErrInvalid, r, c.v))
		}
	}
	t.pending = t.pending[:0]
	err := cudaKernels{d}.elementwise("target check", "convert.cu", "loom_fill_u64", n, t.slots.raw(), noBadRow, int64(n))
	return errors.Join(append(errs, err)...)
}

// freeTargets frees the slots (Close).
func (d *Device) freeTargets() error {
	d.targets.mu.Lock()
	defer d.targets.mu.Unlock()
	if d.targets.slots == nil {
		return nil
	}
	err := d.targets.slots.free()
	d.targets.slots, d.targets.pending = nil, nil
	return err
}
