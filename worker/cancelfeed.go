package worker

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// cancelFeed is a worker's one watch on its bucket of cancels: it hands
// each record, and each change, to the runners of the partition its key
// names, and drops the others' (a runner reads what is stored when it
// starts; see tryWatchCancels). It starts with the first runner that
// needs it, and again after its watch ended.
//
// The watch begins with the last record of each key, as a runner's read
// does, not with the changes alone: a watch of changes only that its
// client restarts (after missed heartbeats) before it delivered any
// would start again from the changes after the restart, and miss those
// between.
type cancelFeed struct {
	w *Worker

	// starting is held while a watch starts, which waits on the server;
	// mu is not, so that the runners join and leave meanwhile.
	starting sync.Mutex

	mu      sync.Mutex
	kv      jetstream.KeyValue
	watch   jetstream.KeyWatcher
	quit    context.CancelFunc // ends the watch's context
	end     chan struct{}      // closed when the watch's goroutine returns
	closed  bool               // Run returned: no watch starts again
	runners map[leasehold.Partition][]*cancels
}

func newCancelFeed(w *Worker) *cancelFeed {
	return &cancelFeed{w: w, runners: map[leasehold.Partition][]*cancels{}}
}

// ensure returns the bucket, once the worker's watch on it runs. A try
// fails when the server says nothing for try; the watch lives until
// close.
func (f *cancelFeed) ensure(ctx context.Context, try time.Duration) (jetstream.KeyValue, error) {
	f.starting.Lock()
	defer f.starting.Unlock()
	f.mu.Lock()
	closed, kv, end := f.closed, f.kv, f.end
	f.mu.Unlock()
	if closed {
		return nil, context.Canceled
	}
	if end != nil {
		select {
		case <-end: // ended: start it again
		default:
			return kv, nil
		}
	}
	bucket := CancelBucket(f.w.cfg.Prefix)
	tctx, cancel := context.WithTimeout(ctx, try)
	defer cancel()
	kv, err := f.w.cfg.JetStream.KeyValue(tctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("open the bucket %s: %w", bucket, err)
	}
	// The watch's consumer is created inside Watch, on the context alone,
	// and a request lost with the connection is never answered: the try
	// gives up on it at try.
	wctx, quit := context.WithCancel(context.Background())
	stop := context.AfterFunc(tctx, quit)
	w, err := kv.WatchAll(wctx)
	if !stop() || err != nil {
		quit()
		if err == nil {
			_ = w.Stop()
			err = fmt.Errorf("no answer within %v: %w", try, context.Cause(tctx))
		}
		return nil, fmt.Errorf("watch %s: %w", bucket, err)
	}
	end = make(chan struct{})
	f.mu.Lock()
	if f.closed {
		// Run returned meanwhile.
		f.mu.Unlock()
		_ = w.Stop()
		quit()
		return nil, context.Canceled
	}
	f.kv, f.watch, f.quit, f.end = kv, w, quit, end
	f.mu.Unlock()
	go f.follow(w, end)
	return kv, nil
}

// follow hands each change the watch brings to the runners of its
// partition.
func (f *cancelFeed) follow(w jetstream.KeyWatcher, end chan struct{}) {
	defer close(end)
	for e := range w.Updates() {
		if e == nil {
			continue
		}
		p, ok := keyPartition(e.Key())
		if !ok {
			continue // no runner's: a record's key names its partition
		}
		f.mu.Lock()
		cs := f.runners[p]
		f.mu.Unlock()
		for _, c := range cs {
			c.update(e)
		}
	}
}

// keyPartition reads the partition a cancel's key ("<p>.s<seq>",
// "<p>.i<digest>") begins with.
func keyPartition(key string) (leasehold.Partition, bool) {
	s, _, ok := strings.Cut(key, ".")
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, false
	}
	return leasehold.Partition(n), true
}

// join hands c the changes of partition p's cancels from now on.
func (f *cancelFeed) join(p leasehold.Partition, c *cancels) {
	f.mu.Lock()
	defer f.mu.Unlock()
	// A copy: follow walks the slice it read without the lock.
	f.runners[p] = append(f.runners[p][:len(f.runners[p]):len(f.runners[p])], c)
}

// leave ends what join began.
func (f *cancelFeed) leave(p leasehold.Partition, c *cancels) {
	f.mu.Lock()
	defer f.mu.Unlock()
	cs := f.runners[p]
	kept := make([]*cancels, 0, len(cs))
	for _, x := range cs {
		if x != c {
			kept = append(kept, x)
		}
	}
	if len(kept) == 0 {
		delete(f.runners, p)
		return
	}
	f.runners[p] = kept
}

// close stops the watch, for good, and waits for it.
func (f *cancelFeed) close() {
	f.mu.Lock()
	f.closed = true
	w, quit, end := f.watch, f.quit, f.end
	f.mu.Unlock()
	if end == nil {
		return
	}
	_ = w.Stop()
	quit()
	<-end
}
