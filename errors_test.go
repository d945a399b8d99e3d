package loom_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/nccl/topology"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/safetensors"
)

// TestOneVocabulary: every package's sentinel of a kind matches the kind,
// wrapped or not, and no other kind.
func TestOneVocabulary(t *testing.T) {
	kinds := []error{loom.ErrInvalid, loom.ErrMismatch, loom.ErrUnsupported}
	for _, tc := range []struct {
		name     string
		sentinel error
		kind     error
	}{
		{"comm.ErrInvalid", comm.ErrInvalid, loom.ErrInvalid},
		{"comm.ErrMismatch", comm.ErrMismatch, loom.ErrMismatch},
		{"comm.ErrUnsupported", comm.ErrUnsupported, loom.ErrUnsupported},
		{"rendezvous.ErrInvalid", rendezvous.ErrInvalid, loom.ErrInvalid},
		{"topology.ErrInvalid", topology.ErrInvalid, loom.ErrInvalid},
		{"mesh.ErrInvalid", mesh.ErrInvalid, loom.ErrInvalid},
		{"mesh.ErrUnknownAxis", mesh.ErrUnknownAxis, loom.ErrInvalid},
		{"placement.ErrInvalid", placement.ErrInvalid, loom.ErrInvalid},
		{"placement.ErrMismatch", placement.ErrMismatch, loom.ErrMismatch},
		{"placement.ErrUnsupported", placement.ErrUnsupported, loom.ErrUnsupported},
		{"autograd.ErrInvalid", autograd.ErrInvalid, loom.ErrInvalid},
		{"autograd.ErrRule", autograd.ErrRule, loom.ErrInvalid},
		{"parallel.ErrInvalid", parallel.ErrInvalid, loom.ErrInvalid},
		{"tp.ErrInvalid", tp.ErrInvalid, loom.ErrInvalid},
		{"ddp.ErrInvalid", ddp.ErrInvalid, loom.ErrInvalid},
		{"fsdp.ErrInvalid", fsdp.ErrInvalid, loom.ErrInvalid},
		{"moe.ErrInvalid", moe.ErrInvalid, loom.ErrInvalid},
		{"moe.ErrMismatch", moe.ErrMismatch, loom.ErrMismatch},
		{"safetensors.ErrInvalid", safetensors.ErrInvalid, loom.ErrInvalid},
	} {
		wrapped := fmt.Errorf("op: %w: detail", tc.sentinel)
		for _, err := range []error{tc.sentinel, wrapped} {
			if !errors.Is(err, tc.sentinel) {
				t.Errorf("%s: %q does not match its own sentinel", tc.name, err)
			}
			for _, k := range kinds {
				if got, want := errors.Is(err, k), k == tc.kind; got != want {
					t.Errorf("%s: errors.Is(%q, %v) = %v, want %v", tc.name, err, k, got, want)
				}
			}
		}
	}
}
