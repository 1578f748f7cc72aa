package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/jspub"
)

// Acquisitions in atomic batches.
//
// A member that takes many partitions at once (a cold start, a member
// taking the share of one that left) writes their partition records in
// one JetStream atomic batch, then their fence records in another, instead
// of two writes each. Every message of a batch is still a compare-and-set
// on its own key, and the server stores all of a batch or none of it, at
// consecutive revisions in the batch's order: each partition's epoch is
// still the revision of the write that acquired it, read off the commit's
// answer. With sync_interval always a write costs an fsync, and a batch
// costs one: on one server, 65,536 partitions' writes one by one take
// about 22 s, and in batches about 4 (the bench's scale_max_write_floor
// rows).
//
// A batch is only an optimisation. Whatever stops it (a key that is not
// as the member thought, the server's limit of open batches, a lost
// answer, a bucket without atomic publish) sends each of its partitions
// down the one-by-one path, with the record the batch tried to write, so
// that an acquisition whose batch did land is settled by finding its own
// token, as after any lost answer.

// Batch sizes. A batch holds at most maxBatch partitions (the server takes
// up to 1000 messages in one). A member that finds its batches refused
// halves the next one, and doubles it after one that lands: during a
// rebalance most partitions it takes are handed off by members still
// releasing them, and one conflict refuses a whole batch, so it soon takes
// them one by one again. Below minBatch it does.
const (
	maxBatch = 256
	minBatch = 4
)

// batchRetries is how often a batch that found the server's table of open
// batches full (or its batch abandoned) is sent again before its
// partitions go one by one.
const batchRetries = 3

// acqBatch is one atomic batch of acquisitions as the group tracks it.
type acqBatch struct {
	size   int   // partitions in it
	left   int   // results not yet handled by the group
	landed bool  // its partition records were written as one batch
	err    error // why they were not
}

// batchItem is one partition of a batch, with the revision its record is
// expected at.
type batchItem struct {
	p     leasehold.Partition
	hint  uint64
	prior prior // what the key holds at hint
}

// errNoAtomicBatch says the buckets cannot take atomic batches.
var errNoAtomicBatch = errors.New("coordinator: the lease and fence-record buckets do not allow atomic batches (run `leasehold init` to allow them)")

// acquireBatch acquires items under sess in atomic batches and returns one
// result per item, in the items' order. When the batch is refused because
// a record is not at the revision expected, it reads the records through
// the stream leader and writes the free ones again in one batch, at the
// revisions read: a partition released by its last holder leaves a marker
// for a while, which a member that watches no partition records cannot
// know of. Everything a batch does not take is acquired one at a time.
func (c *Coordinator) acquireBatch(ctx context.Context, items []batchItem, sess *Lease, b *acqBatch) []acquireResult {
	started := time.Now()
	recs := make([]record, len(items))
	for i := range items {
		recs[i] = c.newRecord(sess)
	}
	out := make([]acquireResult, len(items))
	idx := make([]int, len(items)) // the items the batch is for
	for i := range idx {
		idx[i] = i
	}
	var single []int // the items to acquire one by one
	leases, err := c.writeBatch(ctx, items, recs, idx, sess)
	if err != nil && isRefusal(err) && isConflict(err) {
		var taken []int
		idx, taken = c.rehint(ctx, items, idx)
		single = append(single, taken...)
		if len(idx) > 0 {
			leases, err = c.writeBatch(ctx, items, recs, idx, sess)
		}
	}
	if err != nil {
		c.cfg.Logger.Debug("acquisition batch not written; acquiring its partitions one by one", "partitions", len(idx), "err", err)
		single, idx, leases, b.err = append(single, idx...), nil, nil, err
	}
	c.eachBounded(len(single), func(k int) {
		i := single[k]
		t := partitionTarget(items[i].p)
		l, err := c.acquire(ctx, t, acquireOpts{session: sess, hint: items[i].hint, prior: items[i].prior, prepared: &recs[i]})
		out[i] = acquireResult{p: items[i].p, lease: l, err: err, started: started}
	})
	if len(idx) == 0 {
		return out
	}
	b.landed = true
	c.batches.Add(1)
	ferrs := c.fenceBatch(ctx, leases)
	for k, l := range leases {
		i := idx[k]
		t := partitionTarget(items[i].p)
		l, err := c.handOut(ctx, l, t, acquireOpts{session: sess}, ferrs[k])
		out[i] = acquireResult{p: items[i].p, lease: l, err: err, started: started}
	}
	return out
}

// rehint reads the records of items[idx] through the stream leader, sets
// the hint of each free one (no record, or a marker) to its revision, and
// returns those, and the rest: a record someone holds, or one whose
// session may have ended, which the one-by-one path decides about.
func (c *Coordinator) rehint(ctx context.Context, items []batchItem, idx []int) (free, taken []int) {
	isFree := make([]bool, len(idx))
	c.eachBounded(len(idx), func(k int) {
		it := &items[idx[k]]
		rctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
		defer cancel()
		e, err := c.b.last(rctx, partitionKey(it.p))
		switch {
		case err != nil:
		case e.kind == entryNone:
			it.hint, it.prior, isFree[k] = 0, priorFree, true
		case e.kind == entryMarker:
			it.hint, it.prior, isFree[k] = e.rev, markerPrior(e.header), true
		}
	})
	for k, i := range idx {
		if isFree[k] {
			free = append(free, i)
		} else {
			taken = append(taken, i)
		}
	}
	return free, taken
}

// eachBounded runs f(0) to f(n-1), a few at a time, and returns when all
// have.
func (c *Coordinator) eachBounded(n int, f func(i int)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			f(i)
		})
	}
	wg.Wait()
}

// writeBatch writes the partition records recs[i] of items[i], i in idx,
// in one atomic batch, each a compare-and-set on its item's hint, and
// returns their leases, in idx's order. After an error the batch was
// refused, or its outcome is not known.
func (c *Coordinator) writeBatch(ctx context.Context, items []batchItem, recs []record, idx []int, sess *Lease) ([]*Lease, error) {
	if !c.b.atomic {
		return nil, errNoAtomicBatch
	}
	if err := sess.Err(); err != nil {
		return nil, fmt.Errorf("the member registration ended: %w", err)
	}
	msgs := make([]*nats.Msg, len(idx))
	for k, i := range idx {
		value, err := json.Marshal(recs[i])
		if err != nil {
			return nil, err
		}
		msgs[k] = casMsg(c.b.prefix+partitionKey(items[i].p), value, items[i].hint)
	}
	sent := time.Now()
	ack, err := c.publishBatch(ctx, c.b.stream, msgs)
	if err != nil {
		return nil, err
	}
	revs := batchRevisions(ack.Seq, len(idx))
	// The answer names the last revision only: read the first and the last
	// record back through the leader, so that a server that stored the
	// batch otherwise than in consecutive revisions never hands out a
	// wrong epoch.
	for _, k := range ends(len(idx)) {
		i := idx[k]
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RequestTimeout)
		e, err := c.b.last(rctx, partitionKey(items[i].p))
		cancel()
		if err != nil {
			return nil, fmt.Errorf("read back partition %d: %w", items[i].p, err)
		}
		r, _ := partitionReason(e.data, e.header)
		if e.kind != entryValue || e.rev != revs[k] || r.Token != recs[i].Token {
			return nil, fmt.Errorf("partition %d is at revision %d, not at %d as the batch's answer implies", items[i].p, e.rev, revs[k])
		}
	}
	leases := make([]*Lease, len(idx))
	for k, i := range idx {
		leases[k] = c.newLease(partitionTarget(items[i].p), recs[i], revs[k], sent, sess)
		leases[k].prior = items[i].prior
	}
	return leases, nil
}

// fenceBatch fences leases, fresh from writeBatch, in one atomic batch of
// their fence records, and returns the fence step's error of each. A lease
// whose record the batch cannot fence (one that does not decode, or claims
// its epoch or a later one) or whose batch fails is fenced on its own.
func (c *Coordinator) fenceBatch(ctx context.Context, leases []*Lease) []error {
	errs := make([]error, len(leases))
	type fenceItem struct {
		cur, next fenceRecord
		rev       uint64
		ok        bool
	}
	items := make([]fenceItem, len(leases))
	// Direct gets, which a follower may answer: a stale revision fails the
	// batch, not safety.
	c.eachBounded(len(leases), func(i int) {
		rctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
		defer cancel()
		it := &items[i]
		it.cur, it.next, it.rev, it.ok = leases[i].hintedFence(rctx)
	})
	var idx []int
	var msgs []*nats.Msg
	for i, it := range items {
		if !it.ok {
			continue
		}
		value, err := json.Marshal(it.next)
		if err != nil {
			errs[i] = err
			continue
		}
		idx = append(idx, i)
		msgs = append(msgs, casMsg(c.b.fencePrefix+leases[i].key, value, it.rev))
	}
	done := make([]bool, len(leases))
	if len(msgs) > 0 {
		if revs, err := c.writeFences(ctx, leases, idx, msgs); err != nil {
			c.cfg.Logger.Debug("fence batch not written; fencing its partitions one by one", "partitions", len(msgs), "err", err)
		} else {
			c.fenceBatches.Add(1)
			for j, i := range idx {
				l, it := leases[i], items[i]
				l.pmu.Lock()
				l.fenceRev, l.fenced, l.progRead, l.previous = revs[j], it.next, true, it.cur
				l.pmu.Unlock()
				done[i] = true
			}
		}
	}
	c.eachBounded(len(leases), func(i int) {
		if !done[i] && errs[i] == nil {
			errs[i] = leases[i].fence(ctx, false)
		}
	})
	return errs
}

// writeFences writes msgs, the fence records of leases[idx[j]], in one
// atomic batch and returns their revisions, checked as writeBatch checks
// the partition records'.
func (c *Coordinator) writeFences(ctx context.Context, leases []*Lease, idx []int, msgs []*nats.Msg) ([]uint64, error) {
	ack, err := c.publishBatch(ctx, c.b.fenceStream, msgs)
	if err != nil {
		return nil, err
	}
	revs := batchRevisions(ack.Seq, len(msgs))
	for _, j := range ends(len(msgs)) {
		l := leases[idx[j]]
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RequestTimeout)
		cur, rev, err := c.b.readFence(rctx, l.key)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("read back the fence record of %s: %w", l.key, err)
		}
		if rev != revs[j] || cur.Acquisition != l.info.Acquisition {
			return nil, fmt.Errorf("the fence record of %s is at revision %d, not at %d as the batch's answer implies", l.key, rev, revs[j])
		}
	}
	return revs, nil
}

// publishBatch publishes msgs to stream as one atomic batch, sending it
// again while the server's table of open batches is full.
func (c *Coordinator) publishBatch(ctx context.Context, stream string, msgs []*nats.Msg) (jspub.BatchAck, error) {
	var err error
	for attempt := range batchRetries {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return jspub.BatchAck{}, fmt.Errorf("%w (last attempt: %v)", ctx.Err(), err)
			case <-timeAfter(backoff(attempt + 1)):
			}
		}
		rctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
		var ack jspub.BatchAck
		ack, err = jspub.Batch(rctx, c.b.js.Conn(), msgs)
		cancel()
		if err == nil {
			if ack.Stream != stream {
				return jspub.BatchAck{}, fmt.Errorf("the batch was stored in stream %s, not %s", ack.Stream, stream)
			}
			return ack, nil
		}
		if !batchBusy(err) {
			return jspub.BatchAck{}, err
		}
	}
	return jspub.BatchAck{}, err
}

// batchTooLarge reports whether err is the server's refusal of a batch
// larger than it takes (its max_batch_size is below maxBatch).
func batchTooLarge(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == 10199
}

// batchBusy reports whether err is the server's refusal of a batch that
// may go through when sent again: too many batches open on the stream, or
// a batch abandoned before its commit.
func batchBusy(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == 10210 || apiErr.ErrorCode == 10176)
}

// casMsg is a write of value to subject if the subject's last revision is
// expect (0: none).
func casMsg(subject string, value []byte, expect uint64) *nats.Msg {
	m := nats.NewMsg(subject)
	m.Data = value
	m.Header[jetstream.ExpectedLastSubjSeqHeader] = []string{strconv.FormatUint(expect, 10)}
	return m
}

// batchRevisions are the revisions of the n messages of a batch whose last
// one is at last.
func batchRevisions(last uint64, n int) []uint64 {
	revs := make([]uint64, n)
	for i := range revs {
		revs[i] = last - uint64(n-1-i)
	}
	return revs
}

// ends are the indexes of the first and last of n.
func ends(n int) []int {
	if n == 1 {
		return []int{0}
	}
	return []int{0, n - 1}
}
