package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// acquireWhenFree tries to acquire the partition until the lease on it
// ends, narrating the first refusal.
func acquireWhenFree(ctx context.Context, s *script, b *worker) (*coordinator.Lease, error) {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for said := false; ; {
		l, err := b.coord.Acquire(ctx, part)
		if err == nil {
			return l, nil
		}
		if !errors.Is(err, coordinator.ErrHeld) {
			return nil, fmt.Errorf("worker-b: acquire: %w", err)
		}
		if !said {
			s.say("worker-b: Acquire -> %v", err)
			s.say("worker-b tries again every 100ms until the server expires that lease...")
			said = true
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("worker-b: waiting for partition %d: %w", part, ctx.Err())
		case <-tick.C:
		}
	}
}

func finalState(ctx context.Context, s *script, a, b *worker) error {
	effects, err := b.sink.Effects(ctx)
	if err != nil {
		return fmt.Errorf("read the sink: %w", err)
	}
	s.say("sink contents:")
	for _, e := range effects {
		s.say("  %s = %s   (written by %s under epoch %d, key %s)", e.Subject, e.Data, e.Stamp.Worker, e.Stamp.Epoch, e.Stamp.Key)
	}
	s.say("sink: max epoch for partition %d = %d", part, maxEpoch(ctx, b))
	s.say("sink: stale writes refused = %d (counted by worker-a's sink handle, which refused it,",
		a.sink.Dropped(fence(b))+b.sink.Dropped(fence(b)))
	s.say("      and reported to its logs, metrics and traces)")
	st, err := b.coord.Bucket().Snapshot(ctx)
	if err != nil {
		return fmt.Errorf("read the lease bucket: %w", err)
	}
	for _, p := range st.Partitions {
		if p.Partition == part {
			s.say("lease bucket: partition %d held by %s at epoch %d", p.Partition, p.Holder, p.Epoch)
			s.say("lease bucket: partition %d fenced at epoch %d, progress job %d", p.Partition, p.FencedEpoch, p.Progress)
		}
	}
	s.say("Nothing worker-a wrote after it lost its lease was applied, and no job was skipped.")
	return nil
}

func maxEpoch(ctx context.Context, w *worker) leasehold.Epoch {
	f, err := w.sink.Fence(ctx, fence(w))
	if err != nil {
		return 0
	}
	return f.Epoch
}

// fence is the fence of partition part in w's lease bucket's scope.
func fence(w *worker) leasehold.FenceID {
	return leasehold.FenceID{Scope: w.coord.Bucket().Scope(), Partition: part}
}

// script prints the walk-through: numbered steps, indented lines. It
// keeps the first write error.
type script struct {
	w   io.Writer
	n   int
	err error
}

func (s *script) printf(format string, args ...any) {
	if s.err == nil {
		_, s.err = fmt.Fprintf(s.w, format, args...)
	}
}

func (s *script) step(title string) {
	s.n++
	s.printf("\n%d. %s\n", s.n, title)
}

func (s *script) say(format string, args ...any) { s.printf("   "+format+"\n", args...) }
