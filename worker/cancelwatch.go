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

// cancels is what a runner knows of its partition's cancels, from a watch
// on their keys.
type cancels struct {
	r    *runner
	kv   jetstream.KeyValue
	w    jetstream.KeyWatcher
	quit context.CancelFunc // ends the watch's context
	end  chan struct{}      // closed when the watch's goroutine returns

	mu   sync.Mutex
	recs map[string]cancelEntry
	// The keys of recs by what they name: a job is looked up by its
	// sequence and its ID, without formatting its keys (an ID's is a
	// digest), since nearly every job has no cancel.
	bySeq   map[uint64]string
	byID    map[string]string
	running map[*Job]context.CancelCauseFunc
	stand   map[*Job]bool // the empty attempts that complete cancelled jobs
}

type cancelEntry struct {
	rec     cancelRecord
	rev     uint64
	created time.Time // when the bucket stored it
}

// watchCancels starts the watch of the partition's cancels and waits for
// the records stored so far, so that the first job is checked against
// them. Without the bucket (provisioned by an older release) jobs run
// uncancellable, which it logs. A try that hears nothing from the server
// for apiTry (a request lost with a dropped connection, a server still
// starting) is given up and the watch started again, with backoff, for as
// long as the lease lasts: a partition does not run its jobs unchecked
// against cancels it could not read, and the tries say why in the log
// while its jobs wait (a stall, which Worker.Stalled and /readyz show).
// A non-zero outcome says how the runner ended first.
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
// says nothing for try, at the bucket's lookup, the watch's start or
// between two of the records stored so far.
func (r *runner) tryWatchCancels(try time.Duration) (*cancels, error) {
	bucket := CancelBucket(r.w.cfg.Prefix)
	ctx, cancel := context.WithTimeout(r.ctx, try)
	kv, err := r.w.cfg.JetStream.KeyValue(ctx, bucket)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("open the bucket %s: %w", bucket, err)
	}
	// The watch lives as long as wctx, which ends the try when the server
	// is quiet for too long: the watch's consumer is created inside Watch,
	// on wctx alone, and a request lost with the connection is never
	// answered.
	wctx, wcancel := context.WithCancel(r.ctx)
	quiet := time.AfterFunc(try, wcancel)
	failed := func(err error) (*cancels, error) {
		quiet.Stop()
		wcancel()
		if r.ctx.Err() == nil && errors.Is(err, context.Canceled) {
			err = fmt.Errorf("no answer within %v: %w", try, err)
		}
		return nil, err
	}
	w, err := kv.Watch(wctx, r.p.String()+".*")
	if err != nil {
		return failed(fmt.Errorf("watch %s: %w", bucket, err))
	}
	c := &cancels{r: r, kv: kv, w: w, quit: wcancel, end: make(chan struct{}), recs: map[string]cancelEntry{}, bySeq: map[uint64]string{}, byID: map[string]string{},
		running: map[*Job]context.CancelCauseFunc{}, stand: map[*Job]bool{}}
	for {
		select {
		case e, ok := <-w.Updates():
			switch {
			case wctx.Err() != nil:
				// The try ran out of time while this came.
			case !ok:
				return failed(errors.New("the watch ended before it gave the records stored so far"))
			case !quiet.Stop():
				// The try ran out of time just now.
			case e == nil:
				go c.follow()
				return c, nil
			default:
				c.update(e)
				quiet.Reset(try)
				continue
			}
			_ = w.Stop()
			return failed(context.Canceled)
		case <-wctx.Done():
			_ = w.Stop()
			return failed(context.Cause(wctx))
		}
	}
}

func (c *cancels) follow() {
	defer close(c.end)
	for e := range c.w.Updates() {
		if e != nil {
			c.update(e)
		}
	}
}

// stop ends the watch and waits for it.
func (c *cancels) stop() {
	if c == nil {
		return
	}
	_ = c.w.Stop()
	c.quit()
	<-c.end
}

func (c *cancels) update(e jetstream.KeyValueEntry) {
	key := e.Key()
	if e.Operation() != jetstream.KeyValuePut {
		// Deleted or purged by an operator: the job is not cancelled
		// (one already skipped or stopped stays so).
		c.mu.Lock()
		c.forget(key)
		c.mu.Unlock()
		return
	}
	rec, err := parseCancel(c.r.p, key, e.Value())
	if err != nil {
		c.r.log.Warn("a cancel record does not parse; ignored", "key", key, "err", err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
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
	r.cancels.stand[empty] = true
	r.cancels.mu.Unlock()
	return empty, true, nil
}
