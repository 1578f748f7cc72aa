package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// The runner's side of cancels (see cancel.go): a watch on its
// partition's cancel records, and what a job's attempts do with them.

// cancels is what a runner knows of its partition's cancels: the records
// stored when it started, and every change since, from the worker's one
// watch on the bucket (see cancelFeed), or when that watch is behind, a
// read of its own that ends at the last record stored. A watch per runner, kept for its lease, cost each worker
// process about 30 KiB per partition held (two goroutines and the
// watch's buffers): 4 MiB of a worker's 17 with 128 partitions.
type cancels struct {
	r    *runner
	kv   jetstream.KeyValue
	feed *cancelFeed

	mu   sync.Mutex
	recs map[string]cancelEntry
	// revs is the latest revision seen of each key, a deletion's too: the
	// start's read and the worker's watch may bring one key's changes out
	// of order, and the later one stands.
	revs map[string]uint64
	// The keys of recs by what they name: a job is looked up by its
	// sequence and its ID, without formatting its keys (an ID's is a
	// digest), since nearly every job has no cancel.
	bySeq   map[uint64]string
	byID    map[string]string
	running map[*Job]context.CancelCauseFunc
	stand   map[*Job]bool // the empty attempts that complete cancelled jobs
}

// newCancels leaves the maps of records nil until a record comes: most
// partitions never see one, and a worker holds many.
func newCancels(r *runner, kv jetstream.KeyValue, feed *cancelFeed) *cancels {
	return &cancels{r: r, kv: kv, feed: feed, running: map[*Job]context.CancelCauseFunc{}}
}

// made makes the maps of records; c.mu is held.
func (c *cancels) made() {
	if c.revs == nil {
		c.recs, c.revs, c.bySeq, c.byID = map[string]cancelEntry{}, map[string]uint64{}, map[uint64]string{}, map[string]string{}
	}
}

type cancelEntry struct {
	rec     cancelRecord
	rev     uint64
	created time.Time // when the bucket stored it
}

// watchCancels reads the partition's cancels stored so far, so that the
// first job is checked against them, and follows them from there through
// the worker's watch. Without the bucket (provisioned by an older
// release) jobs run uncancellable, which it logs. A try that hears
// nothing from the server for apiTry (a request lost with a dropped
// connection, a server still starting) is given up and started again,
// with backoff, for as long as the lease lasts: a partition does not run
// its jobs unchecked against cancels it could not read, and the tries say
// why in the log while its jobs wait (a stall, which Worker.Stalled and
// /readyz show). A non-zero outcome says how the runner ended first.
func (r *runner) watchCancels() (*cancels, outcome) {
	for attempt := 1; ; attempt++ {
		c, err := r.tryWatchCancels(apiTry(attempt - 1))
		if err == nil {
			return c, 0
		}
		if r.ctx.Err() != nil {
			return nil, outLost
		}
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			r.log.Warn("jobs cannot be cancelled: the bucket of cancels is missing; run worker.ProvisionJobs (leasehold init)", "bucket", CancelBucket(r.w.cfg.Prefix), "err", err)
			return nil, 0
		}
		wait := min(50*time.Millisecond<<min(attempt-1, 6), 2*time.Second)
		log := r.log.Debug // one failure is a blip: a restart
		if attempt%5 == 2 {
			log = r.log.Warn // again and again: say why the jobs wait
		}
		log("reading the partition's cancels failed; trying again before handling any job", "attempt", attempt, "backoff", wait, "err", err)
		if out := r.sleep(wait, nil); out != 0 {
			return nil, out
		}
	}
}

// tryWatchCancels is one try of watchCancels: it fails when the server
// says nothing for try, at the bucket's lookup, a watch's start, the
// question for its last sequence or between two of the records stored
// so far.
//
// The runner takes the records stored so far from the worker's watch,
// once that has come up to the bucket's last record (cancelFeed.caughtUp).
// When it does not within try, the runner joins the watch and reads what
// is stored itself: a change stored before the read is in it, and one
// stored after comes through the worker's watch, which had begun.
func (r *runner) tryWatchCancels(try time.Duration) (*cancels, error) {
	kv, err := r.w.cancelFeed.ensure(r.ctx, try)
	if err != nil {
		return nil, err
	}
	c := newCancels(r, kv, r.w.cancelFeed)
	for again := true; ; again = false {
		err = c.feed.caughtUp(r.ctx, kv, r.p, c, try)
		if err == nil {
			return c, nil
		}
		if !errors.Is(err, errFeedBehind) {
			return nil, fmt.Errorf("read %s: %w", CancelBucket(r.w.cfg.Prefix), err)
		}
		if !again || !c.feed.isStale() {
			break
		}
		// The watch no longer matches the stream (made again, or a
		// record removed without a change): start it again, for every
		// runner it feeds, and ask once more.
		if kv, err = c.feed.ensure(r.ctx, try); err != nil {
			return nil, err
		}
	}
	r.log.Debug("reading the partition's cancels from the bucket: the worker's watch is behind", "err", err)
	c.feed.join(r.p, c)
	if err := readStored(r.ctx, kv, r.p.String()+".*", try, c.update); err != nil {
		c.feed.leave(r.p, c)
		return nil, fmt.Errorf("read %s: %w", CancelBucket(r.w.cfg.Prefix), err)
	}
	return c, nil
}

// readStored hands each record of kv under keys to fn, up to the last one
// stored when it began, and fails when the server says nothing for try.
func readStored(ctx context.Context, kv jetstream.KeyValue, keys string, try time.Duration, fn func(jetstream.KeyValueEntry)) error {
	// The watch lives as long as wctx, which ends the read when the
	// server is quiet for too long: the watch's consumer is created
	// inside Watch, on wctx alone, and a request lost with the connection
	// is never answered.
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	quiet := time.AfterFunc(try, wcancel)
	defer quiet.Stop()
	timedOut := func(err error) error {
		if ctx.Err() == nil && errors.Is(err, context.Canceled) {
			return fmt.Errorf("no answer within %v: %w", try, err)
		}
		return err
	}
	w, err := kv.Watch(wctx, keys)
	if err != nil {
		return timedOut(fmt.Errorf("watch: %w", err))
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case e, ok := <-w.Updates():
			switch {
			case wctx.Err() != nil:
				// The read ran out of time while this came.
			case !ok:
				return errors.New("the watch ended before it gave the records stored so far")
			case !quiet.Stop():
				// The read ran out of time just now.
			case e == nil:
				return nil
			default:
				fn(e)
				quiet.Reset(try)
				continue
			}
			return timedOut(context.Canceled)
		case <-wctx.Done():
			return timedOut(context.Cause(wctx))
		}
	}
}

// stop stops following the partition's cancels.
func (c *cancels) stop() {
	if c == nil {
		return
	}
	c.feed.leave(c.r.p, c)
}

func (c *cancels) update(e jetstream.KeyValueEntry) {
	key, put := e.Key(), e.Operation() == jetstream.KeyValuePut
	var rec cancelRecord
	var err error
	if put {
		rec, err = parseCancel(c.r.p, key, e.Value())
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e.Revision() <= c.revs[key] {
		return // older than a change seen already
	}
	c.made()
	c.revs[key] = e.Revision()
	if !put {
		// Deleted or purged by an operator: the job is not cancelled
		// (one already skipped or stopped stays so).
		c.forget(key)
		return
	}
	if err != nil {
		c.r.log.Warn("a cancel record does not parse; ignored", "key", key, "err", err)
		return
	}
	ce := cancelEntry{rec: rec, rev: e.Revision(), created: e.Created()}
	c.forget(key)
	c.recs[key] = ce
	// parseCancel checked the key against what the record names: an ID
	// record's key is its ID's, a sequence record's its sequence's.
	if rec.ID != "" {
		c.byID[rec.ID] = key
	} else {
		c.bySeq[rec.Seq] = key
	}
	for job, cc := range c.running {
		if c.matches(job, key, ce) {
			cc(ErrJobCancelled)
		}
	}
}

// forget drops the record at key, if any; c.mu is held.
func (c *cancels) forget(key string) {
	e, ok := c.recs[key]
	if !ok {
		return
	}
	delete(c.recs, key)
	if e.rec.ID != "" {
		if c.byID[e.rec.ID] == key {
			delete(c.byID, e.rec.ID)
		}
	} else if c.bySeq[e.rec.Seq] == key {
		delete(c.bySeq, e.rec.Seq)
	}
}

func (c *cancels) matches(job *Job, key string, e cancelEntry) bool {
	return e.rec.names(c.r.w.cfg.Prefix, key, e.created, job.Partition, job.Seq, job.Enqueued, job.Header)
}

// of returns the cancel of job, if any.
func (c *cancels) of(job *Job) (string, cancelEntry, bool) {
	if c == nil {
		return "", cancelEntry{}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.recs) == 0 {
		return "", cancelEntry{}, false
	}
	if k, ok := c.bySeq[job.Seq]; ok && c.matches(job, k, c.recs[k]) {
		return k, c.recs[k], true
	}
	if job.ID != "" {
		if k, ok := c.byID[job.ID]; ok && c.matches(job, k, c.recs[k]) {
			return k, c.recs[k], true
		}
	}
	return "", cancelEntry{}, false
}

// has reports whether job is cancelled.
func (c *cancels) has(job *Job) bool {
	_, _, ok := c.of(job)
	return ok
}

// late reports whether the runner must not send job's finals: it was
// cancelled, and job is not the empty attempt that completes it.
func (c *cancels) late(job *Job) bool {
	if c == nil {
		return false
	}
	c.mu.Lock()
	stand := c.stand[job]
	delete(c.stand, job)
	c.mu.Unlock()
	return !stand && c.has(job)
}

// attach returns ctx, cancelled with the cause ErrJobCancelled when job's
// cancel arrives (at once if it has), and its cancel, for detach.
func (c *cancels) attach(ctx context.Context, job *Job) (context.Context, context.CancelCauseFunc) {
	if c == nil {
		return ctx, nil
	}
	ctx, cc := context.WithCancelCause(ctx)
	c.mu.Lock()
	c.running[job] = cc
	c.mu.Unlock()
	if c.has(job) {
		cc(ErrJobCancelled)
	}
	return ctx, cc
}

// detach ends what attach began for job, whose context's cancel is cc.
func (c *cancels) detach(job *Job, cc context.CancelCauseFunc) {
	if c == nil {
		return
	}
	c.mu.Lock()
	delete(c.running, job)
	c.mu.Unlock()
	cc(nil)
}

// cancelled settles the attempt job of j if j is cancelled: it aborts the
// attempt's effects, records the cancel's outcome, and returns an empty
// attempt that completes the job. An error means the outcome could not be
// recorded: the attempt fails, and the next one tries again.
func (r *runner) cancelled(j *jobRun, job *Job, st retryState, ran bool) (*Job, bool, error) {
	key, e, ok := r.cancels.of(job)
	if !ok {
		return nil, false, nil
	}
	if e.rec.Cancelled == nil {
		rec := e.rec
		rec.Cancelled = &cancelOutcome{Seq: job.Seq, Epoch: r.info.Epoch, Worker: r.info.Holder, Running: ran,
			Earlier: !r.info.Acquired.IsZero() && job.Enqueued.Before(r.info.Acquired.Add(cancelSkew))}
		val, _ := json.Marshal(rec)
		ctx, cancel := context.WithTimeout(r.ctx, r.w.cfg.EffectTimeout)
		_, err := r.cancels.kv.Update(ctx, key, val, e.rev)
		cancel()
		if err != nil && !casConflict(err) {
			// The attempt fails, and its effects are aborted there.
			return job, true, fmt.Errorf("%w: recording the cancel of job %d failed: %w", ErrJobCancelled, job.Seq, err)
		}
		// A conflict: another holder recorded it first.
	}
	r.abort(job, job.sentSubjects())
	r.log.Info("job cancelled", "seq", job.Seq, "id", job.ID, "running", ran)
	empty := r.newJob(j.m, j.md, st.runs)
	empty.wire = r.wire.Add(1)
	_, _ = empty.close()
	r.cancels.mu.Lock()
	if r.cancels.stand == nil {
		r.cancels.stand = map[*Job]bool{}
	}
	r.cancels.stand[empty] = true
	r.cancels.mu.Unlock()
	return empty, true, nil
}
