package worker

import (
	"context"
	"errors"
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
// names, and keeps the last record of every key, so that a runner that
// starts reads what is stored from it (see tryWatchCancels). It starts
// with the first runner that needs it, and again after its watch ended.
//
// The watch begins with the last record of each key, not with the changes
// alone: a watch of changes only that its client restarts (after missed
// heartbeats) before it delivered any would start again from the changes
// after the restart, and miss those between.
//
// What the feed keeps is only as new as the watch has come. A runner that
// starts takes it once the watch has delivered the bucket's last sequence
// as the server gave it after the runner asked (caughtUp): every record
// stored before the runner started is then in it, or superseded by a
// change the watch brings later. The runners that start together share
// one such question (lastSeq), where a read of its own for each (a
// consumer made and deleted) made a cold start of 128 partitions a
// process take half again as long.
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

	// The running watch's view: the last record of each key, the
	// highest revision delivered, and a channel closed (and replaced)
	// when seen moves or the watch ends.
	recs  map[leasehold.Partition]map[string]jetstream.KeyValueEntry
	loose map[string]uint64 // the revisions of keys that name no partition
	nkeys uint64            // in recs and loose
	// pruned is the stream's first sequence when the kept keys were last
	// walked for those below it.
	pruned uint64
	seen   uint64
	moved  chan struct{}
	// stuck is a last sequence the watch did not come to within a try
	// (removed from the stream, it never will): the runners that get the
	// same answer read the bucket themselves at once.
	stuck uint64
	// The stream the running watch follows: when it was made (a bucket
	// deleted and made again, or restored, numbers its records from 1
	// again), and whether it keeps one message a key (then, caught up
	// exactly, the watch holds as many keys as the stream messages).
	created time.Time
	single  bool
	// stale says the running watch no longer matches the stream: the
	// next ensure starts another. recount is the last sequence at which
	// a count that did not match asked for one, so that a count that
	// never matches does not start a watch per partition.
	stale   bool
	recount uint64

	asks   []*lastAsk // runners waiting for the next lastSeq
	asking bool       // a goroutine answers them (ask)
	life   context.Context
	kill   context.CancelFunc
	askers sync.WaitGroup

	delivered func(jetstream.KeyValueEntry) // for tests: called as each change comes, before it counts
}

func newCancelFeed(w *Worker) *cancelFeed {
	life, kill := context.WithCancel(context.Background())
	return &cancelFeed{w: w, runners: map[leasehold.Partition][]*cancels{}, recs: map[leasehold.Partition]map[string]jetstream.KeyValueEntry{}, loose: map[string]uint64{},
		moved: make(chan struct{}), life: life, kill: kill}
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
			f.mu.Lock()
			stale, w, quit := f.stale, f.watch, f.quit
			f.mu.Unlock()
			if !stale {
				return kv, nil
			}
			_ = w.Stop()
			quit()
			<-end
		}
	}
	bucket := CancelBucket(f.w.cfg.Prefix)
	tctx, cancel := context.WithTimeout(ctx, try)
	defer cancel()
	kv, err := f.w.cfg.JetStream.KeyValue(tctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("open the bucket %s: %w", bucket, err)
	}
	// The stream's identity before the watch starts: made again between
	// the two, the watch follows the new one, and the next runner's
	// question finds another time and starts the watch again.
	st, err := kv.Status(tctx)
	if err != nil {
		return nil, fmt.Errorf("status of %s: %w", bucket, err)
	}
	created, single := streamIdentity(st)
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
	// A new watch delivers the last record of every key again; what the
	// last one kept may hold records deleted since.
	f.recs, f.loose, f.nkeys, f.pruned = map[leasehold.Partition]map[string]jetstream.KeyValueEntry{}, map[string]uint64{}, 0, 0
	f.seen, f.stuck = 0, 0
	f.created, f.single, f.stale = created, single, false
	f.mu.Unlock()
	go f.follow(w, end)
	return kv, nil
}

// follow hands each change the watch brings to the runners of its
// partition.
func (f *cancelFeed) follow(w jetstream.KeyWatcher, end chan struct{}) {
	defer func() {
		f.mu.Lock()
		f.bump()
		f.mu.Unlock()
		close(end)
	}()
	for e := range w.Updates() {
		if e == nil {
			continue
		}
		if f.delivered != nil {
			f.delivered(e)
		}
		p, ok := keyPartition(e.Key())
		f.mu.Lock()
		if e.Revision() > f.seen {
			f.seen = e.Revision()
			f.bump()
		}
		// Every key, deletions too: the count is checked against the
		// stream's (caughtUp).
		f.keep(p, ok, e)
		var cs []*cancels
		if ok {
			cs = f.runners[p]
		} // else no runner's: a record's key names its partition
		f.mu.Unlock()
		for _, c := range cs {
			c.update(e)
		}
	}
}

// keep keeps e as its key's last record; f.mu is held. p is the
// partition the key names, when ok.
func (f *cancelFeed) keep(p leasehold.Partition, ok bool, e jetstream.KeyValueEntry) {
	if !ok {
		if _, had := f.loose[e.Key()]; !had {
			f.nkeys++
		}
		f.loose[e.Key()] = e.Revision()
		return
	}
	m := f.recs[p]
	if m == nil {
		m = map[string]jetstream.KeyValueEntry{}
		f.recs[p] = m
	}
	if _, had := m[e.Key()]; !had {
		f.nkeys++
	}
	m[e.Key()] = e
}

// prune drops the kept keys whose revision is below first, removed from
// the stream without a change to watch (a purge of the stream, not of a
// key); f.mu is held. It walks them only when first has moved.
func (f *cancelFeed) prune(first uint64) {
	if first <= f.pruned {
		return
	}
	f.pruned = first
	for p, m := range f.recs {
		for k, e := range m {
			if e.Revision() < first {
				delete(m, k)
				f.nkeys--
			}
		}
		if len(m) == 0 {
			delete(f.recs, p)
		}
	}
	for k, rev := range f.loose {
		if rev < first {
			delete(f.loose, k)
			f.nkeys--
		}
	}
}

// bump wakes those waiting for the watch to move; f.mu is held.
func (f *cancelFeed) bump() {
	close(f.moved)
	f.moved = make(chan struct{})
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
	f.joinLocked(p, c)
}

// joinLocked is join with f.mu held.
func (f *cancelFeed) joinLocked(p leasehold.Partition, c *cancels) {
	// A copy: follow walks the slice it read without the lock.
	f.runners[p] = append(f.runners[p][:len(f.runners[p]):len(f.runners[p])], c)
}

// isStale reports whether the running watch no longer matches the
// stream, and the next ensure starts another.
func (f *cancelFeed) isStale() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stale
}

// errFeedBehind says the worker's watch had not delivered the bucket's
// last sequence within a try: the runner reads what is stored itself.
var errFeedBehind = errors.New("the worker's watch of cancels has not come up to the bucket's last record")

// caughtUp hands c the records of partition p that the worker's watch
// keeps, once it has delivered every record stored before the call, and
// joins c to the watch's changes from there, in one step under f.mu: a
// change is in what c is handed, or comes after. It fails with
// errFeedBehind when the watch has not come that far within try (the
// bucket's last message removed by an operator's purge of its subject,
// which a watch that starts afterwards never delivers), and when the
// server does not say its last sequence within try.
//
// A record removed that way after the watch delivered it writes no
// change to watch. Where the bucket keeps one message a key, the count
// of keys shows it when the watch is caught up exactly: the watch is
// marked stale, and the runner starts it again (tryWatchCancels). When
// more came since, the runner may take the record, and skips the job its
// cancel named, as one that had read it before the purge would. A purge
// of the key (KeyValue.Purge or Delete) writes a marker, which the watch
// follows. A bucket made again under the same name (its stream made at
// another time) marks the watch stale too.

func (f *cancelFeed) caughtUp(ctx context.Context, kv jetstream.KeyValue, p leasehold.Partition, c *cancels, try time.Duration) error {
	a, err := f.lastSeq(ctx, kv, try)
	if err != nil {
		return err
	}
	first, last := a.first, a.last
	timer := time.NewTimer(try)
	defer timer.Stop()
	for {
		f.mu.Lock()
		if f.end == nil || closedChan(f.end) {
			// Ended: its next start comes with a runner's ensure.
			f.mu.Unlock()
			return errFeedBehind
		}
		if f.seen < last && last == f.stuck {
			f.mu.Unlock()
			return errFeedBehind
		}
		if !a.created.Equal(f.created) {
			// Another stream under the bucket's name (deleted and made
			// again, or restored): what the watch delivered is not what
			// is stored.
			f.stale = true
			f.mu.Unlock()
			return errFeedBehind
		}
		f.prune(first)
		if f.seen == last && f.single && f.nkeys != a.msgs && f.recount != last {
			// Caught up exactly, and a key's message is missing or one
			// more: removed without a change to watch (a purge of its
			// subject).
			f.stale, f.recount = true, last
			f.mu.Unlock()
			return errFeedBehind
		}
		if f.seen >= last {
			var mine []jetstream.KeyValueEntry
			for _, e := range f.recs[p] {
				if e.Operation() == jetstream.KeyValuePut {
					mine = append(mine, e)
				}
			}
			f.joinLocked(p, c)
			f.mu.Unlock()
			for _, e := range mine {
				c.update(e)
			}
			return nil
		}
		moved := f.moved
		f.mu.Unlock()
		select {
		case <-moved:
		case <-timer.C:
			f.mu.Lock()
			f.stuck = last
			f.mu.Unlock()
			return errFeedBehind
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

func closedChan(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// lastAsk is a runner's question for lastSeq, answered once.
type lastAsk struct {
	done        chan struct{}
	first, last uint64
	msgs        uint64
	created     time.Time
	err         error
}

// lastSeq returns the first and last sequences of the bucket's stream,
// from a request sent after the call: the runners that ask while one is
// on its way share the next one. An empty stream's last is 0: nothing
// stored can be missed. The request fails when the server says nothing
// for try.
func (f *cancelFeed) lastSeq(ctx context.Context, kv jetstream.KeyValue, try time.Duration) (*lastAsk, error) {
	a := &lastAsk{done: make(chan struct{})}
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return nil, context.Canceled
	}
	f.asks = append(f.asks, a)
	if !f.asking {
		f.asking = true
		f.askers.Add(1)
		go f.ask(kv, try)
	}
	f.mu.Unlock()
	select {
	case <-a.done:
		return a, a.err
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

// ask answers the runners' questions, one request for all those waiting
// when it is sent, until none waits.
func (f *cancelFeed) ask(kv jetstream.KeyValue, try time.Duration) {
	defer f.askers.Done()
	for {
		f.mu.Lock()
		asks := f.asks
		f.asks = nil
		if len(asks) == 0 {
			f.asking = false
			f.mu.Unlock()
			return
		}
		f.mu.Unlock()
		ctx, cancel := context.WithTimeout(f.life, try)
		ans, err := bucketSeqs(ctx, kv)
		cancel()
		for _, a := range asks {
			a.first, a.last, a.msgs, a.created, a.err = ans.first, ans.last, ans.msgs, ans.created, err
			close(a.done)
		}
	}
}

// bucketSeqs returns the first and last sequences of kv's stream (the
// last is 0 when it holds no message), its count of messages and when it
// was made.
func bucketSeqs(ctx context.Context, kv jetstream.KeyValue) (lastAsk, error) {
	st, err := kv.Status(ctx)
	if err != nil {
		return lastAsk{}, err
	}
	bs, ok := st.(*jetstream.KeyValueBucketStatus)
	if !ok || bs.StreamInfo() == nil {
		return lastAsk{}, fmt.Errorf("the status of %s does not say its stream's sequences", st.Bucket())
	}
	state := bs.StreamInfo().State
	a := lastAsk{first: state.FirstSeq, last: state.LastSeq, msgs: state.Msgs, created: bs.StreamInfo().Created}
	if state.Msgs == 0 {
		a.first, a.last = state.LastSeq+1, 0
	}
	return a, nil
}

// streamIdentity returns when st's stream was made, and whether it keeps
// one message a key.
func streamIdentity(st jetstream.KeyValueStatus) (time.Time, bool) {
	bs, ok := st.(*jetstream.KeyValueBucketStatus)
	if !ok || bs.StreamInfo() == nil {
		return time.Time{}, false
	}
	return bs.StreamInfo().Created, bs.StreamInfo().Config.MaxMsgsPerSubject == 1
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
	f.kill()
	f.askers.Wait()
	if end == nil {
		return
	}
	_ = w.Stop()
	quit()
	<-end
}
