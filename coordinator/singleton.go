package coordinator

import (
	"context"
	"errors"
	"fmt"

	"github.com/leasehold/leasehold"
)

// Campaign waits until this worker leads the election name, and returns
// the lease that makes it the leader: leadership is the lock on name, and
// the lease's epoch orders the leaders. Resign by releasing the lease;
// leadership ends, and the lease's Context with it, when the lease is
// lost.
func (c *Coordinator) Campaign(ctx context.Context, name string) (*Lease, error) {
	return c.Lock(ctx, name)
}

// ErrSingletonFailing is matched by the error RunSingleton returns when
// campaigns fail without an answer from the server too many times in a
// row.
var ErrSingletonFailing = errors.New("coordinator: singleton campaigns keep failing")

// maxFailedCampaigns bounds the campaigns RunSingleton retries after they
// fail for reasons other than another holder.
const maxFailedCampaigns = 10

// RunSingleton runs fn while this worker holds the lock name: it
// campaigns, calls fn with a context that ends when the lease is lost (or
// ctx ends), and when the lease was lost campaigns again and calls fn anew
// under the new, higher epoch. The server lets one lease on name live at a
// time, and a fn whose lease is lost has its context cancelled at the next
// refused renewal or at its local deadline; but a process cannot see its
// own pauses, so two fns may run for a while, one of them on a lease it no
// longer has. That is what the epoch is for: fn writes through sinks
// stamped with l.Info().Stamp, and a run that overstays its lease is
// refused by the sinks once its successor has written.
//
// RunSingleton returns when ctx ends (nil), when fn returns while still
// holding the lease (fn's result, after releasing the lease, so the next
// campaigner takes over at once), or when campaigns fail without an answer
// from the server maxFailedCampaigns times in a row.
func (c *Coordinator) RunSingleton(ctx context.Context, name string, fn func(ctx context.Context, l *Lease) error) error {
	failed := 0
	for {
		l, err := c.Lock(ctx, name)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if failed++; failed >= maxFailedCampaigns {
				return fmt.Errorf("%w: lock %q: %d in a row, the last: %w", ErrSingletonFailing, name, failed, err)
			}
			c.cfg.Logger.Warn("singleton campaign failed; campaigning again", "lock", name, "failures", failed, "err", err)
			select {
			case <-ctx.Done():
				return nil
			case <-timeAfter(backoff(failed)):
			}
			continue
		}
		failed = 0
		c.cfg.Logger.Info("singleton leads", "lock", name, "epoch", l.Epoch(), "worker", c.cfg.Worker)
		ferr := runHeld(ctx, l, fn)
		if lost := l.Err(); lost != nil && !errors.Is(lost, ErrReleased) {
			if ctx.Err() != nil {
				return nil
			}
			c.cfg.Logger.Warn("singleton lost its lease; campaigning again", "lock", name, "epoch", l.Epoch(), "cause", lost)
			continue
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*c.cfg.RequestTimeout)
		rerr := l.Release(rctx)
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		if rerr != nil && !errors.Is(rerr, leasehold.ErrLeaseLost) {
			c.cfg.Logger.Warn("singleton release failed; the lease expires on its own", "lock", name, "err", rerr)
		}
		return ferr
	}
}

// runHeld calls fn with a context that ends when ctx ends or the lease
// ends, whose cause is the lease's then.
func runHeld(ctx context.Context, l *Lease, fn func(context.Context, *Lease) error) error {
	fctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(l.Context(), func() { cancel(context.Cause(l.Context())) })
	defer stop()
	return fn(fctx, l)
}
