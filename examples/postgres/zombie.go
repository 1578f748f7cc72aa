package main

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/leasehold/leasehold"
)

// zombie freezes one worker in the middle of one job, after it has taken
// the job's stamp and before it writes, the way a stop-the-world pause or a
// hung call would, and lets it write when woken. It is the example's only
// piece of stagecraft; a real handler has none of it.
type zombie struct {
	worker string // the worker that freezes
	order  string // in the middle of this order

	frozen chan leasehold.Stamp // receives the stamp it holds, once frozen
	wake   chan struct{}        // closed to let it write
	done   chan error           // what its write came to

	used     atomic.Bool
	aborted  atomic.Bool
	wakeOnce sync.Once
}

func newZombie(worker, order string) *zombie {
	return &zombie{
		worker: worker,
		order:  order,
		frozen: make(chan leasehold.Stamp, 1),
		wake:   make(chan struct{}),
		done:   make(chan error, 1),
	}
}

// here reports whether the write stamped st for this order is the one to
// freeze in; it says yes once.
func (z *zombie) here(st leasehold.Stamp, order string) bool {
	return z != nil && st.Worker == z.worker && order == z.order && z.used.CompareAndSwap(false, true)
}

// freeze waits until woken, then writes. The write uses a context that
// outlives the lease: the worker cancelled the handler's context when the
// lease went, but a process that froze in the middle of a write never gets
// to look at its context before the write goes out. What stops it is the
// fence, not the context.
func (z *zombie) freeze(ctx context.Context, st leasehold.Stamp, write func(context.Context) error) error {
	z.frozen <- st
	<-z.wake
	if z.aborted.Load() {
		return errAborted
	}
	err := write(context.WithoutCancel(ctx))
	z.done <- err
	return err
}

// wakeUp lets the frozen worker go on and write; it is safe to call more
// than once.
func (z *zombie) wakeUp() { z.wakeOnce.Do(func() { close(z.wake) }) }

// abort lets the frozen worker go on without writing, when the example
// stops early.
func (z *zombie) abort() {
	z.aborted.Store(true)
	z.wakeUp()
}

var errAborted = errors.New("the example stopped before the frozen worker woke up")
