package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// JobState is where a job is in its life.
type JobState int

// Job states. A job is Scheduled until its due time (delayed jobs), then
// Pending until the partition's holder reaches it, Running while it is the
// partition's first job not committed, and Done or DeadLettered once the
// partition's committed progress has passed it or counts it among the jobs
// done beyond it. A job's handler may have
// returned a little before its status says Done: progress is committed
// every Config.CommitEvery.
//
// A dead-lettered job that `leasehold dlq replay` sent back is Replayed
// (JobStatus.ReplayedAs names the new job, whose status is its own), and
// one that `leasehold dlq purge` deleted is Purged. A job removed from the
// job stream before it ran (aged out, deleted) is RemovedUnrun. None of
// them is ever reported Done: Done means its handler succeeded. A job
// that Producer.Cancel stopped or skipped is Cancelled.
const (
	JobUnknown JobState = iota
	JobScheduled
	JobPending
	JobRunning
	JobDone
	JobDeadLettered
	JobReplayed
	JobPurged
	JobRemovedUnrun
	JobCancelled
)

var stateNames = [...]string{"unknown", "scheduled", "pending", "running", "done", "dead-lettered", "replayed", "purged", "removed-unrun", "cancelled"}

func (s JobState) String() string {
	if s >= 0 && int(s) < len(stateNames) {
		return stateNames[s]
	}
	return "JobState(" + strconv.Itoa(int(s)) + ")"
}

// MarshalText writes the state's name.
func (s JobState) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Finished reports whether the job will not run again under its
// reference: done, dead-lettered, replayed (as another job), purged or
// removed unrun, or cancelled.
func (s JobState) Finished() bool { return s >= JobDone && s <= JobCancelled }

// JobStatus is what the streams and the lease bucket say about one job.
type JobStatus struct {
	Ref       string              `json:"ref"` // Enqueued.Ref
	ID        string              `json:"id,omitempty"`
	Partition leasehold.Partition `json:"partition"`
	// Seq is the job's sequence in the job stream; for a delayed job that
	// has not fired, its schedule's.
	Seq   uint64    `json:"seq"`
	State JobState  `json:"state"`
	Due   time.Time `json:"due,omitzero"` // a delayed job's due time
	// Holder and Epoch are the partition's live lease, when it has one:
	// for a running job, who runs it under which epoch.
	Holder string          `json:"holder,omitempty"`
	Epoch  leasehold.Epoch `json:"epoch,omitempty"`
	// Progress is the partition's committed progress: the last job
	// sequence it finished.
	Progress uint64 `json:"progress"`
	// Error is a dead-lettered job's last failure, and DeadLetter its
	// sequence in the dead-letter stream (also for a job replayed or
	// purged: the dead letter that was).
	Error      string `json:"error,omitempty"`
	DeadLetter uint64 `json:"dead_letter,omitempty"`
	// ReplayedAs is, for JobReplayed, the reference of the job the replay
	// stored.
	ReplayedAs string `json:"replayed_as,omitempty"`
	// Via lists, in Wait's answers, the jobs whose replays Wait followed
	// to reach this one, the job it was asked about first.
	Via []string `json:"via,omitempty"`
	// Detail says what could not be found, for JobUnknown.
	Detail string `json:"detail,omitempty"`

	// removed: the job stream no longer holds the job (trimmed once
	// done, or aged out or deleted before it ran).
	removed bool
}

// goneUnrun says a removed job will never run: its partition's
// progress, read after the job was found missing, has not reached it.
func (st JobStatus) goneUnrun() bool { return st.removed && st.Progress < st.Seq }

const goneDetail = "the job stream no longer holds the job and its partition's progress never reached it: it aged out (MaxAge) or was deleted before it ran"

// Ref names the job for Status, ParseRef and `leasehold jobs`:
// "<partition>:<seq>", and for a delayed job
// "<partition>:<seq>@<due, Unix seconds>/<ID>".
func (e Enqueued) Ref() string {
	r := e.Partition.String() + ":" + strconv.FormatUint(e.Seq, 10)
	if !e.Due.IsZero() {
		r += "@" + strconv.FormatInt(e.Due.Unix(), 10) + "/" + e.ID
	}
	return r
}

// ParseRef reads a job reference written by Enqueued.Ref.
func ParseRef(s string) (Enqueued, error) {
	bad := func(why string) (Enqueued, error) {
		return Enqueued{}, fmt.Errorf("worker: job reference %q: %s; write <partition>:<seq>, or <partition>:<seq>@<due>/<id> for a delayed job, as enqueue prints it", s, why)
	}
	base, delayed, isDelayed := strings.Cut(s, "@")
	ps, seqs, ok := strings.Cut(base, ":")
	if !ok {
		return bad("no ':'")
	}
	p, err := leasehold.ParsePartition(ps)
	if err != nil {
		return bad(err.Error())
	}
	seq, err := strconv.ParseUint(seqs, 10, 64)
	if err != nil || seq == 0 {
		return bad("the sequence is not a positive number")
	}
	e := Enqueued{Partition: p, Seq: seq}
	if isDelayed {
		dues, id, ok := strings.Cut(delayed, "/")
		unix, err := strconv.ParseInt(dues, 10, 64)
		if !ok || err != nil || id == "" || validID(id) != nil {
			return bad("the delayed part is not <due, Unix seconds>/<id>")
		}
		e.Due, e.ID = time.Unix(unix, 0).UTC(), id
	}
	return e, nil
}

// maxScan bounds the messages a status query reads to find a fired
// delayed job or a dead letter.
const maxScan = 100_000

// status is Status without the cancels (cancel.go).
func (p *Producer) status(ctx context.Context, ref Enqueued) (JobStatus, error) {
	b, err := p.bucket()
	if err != nil {
		return JobStatus{}, err
	}
	st, err := p.locate(ctx, ref)
	if err != nil || st.State != JobUnknown || st.Detail != "" {
		return st, err
	}
	c, err := b.PartitionCommitted(ctx, st.Partition)
	if err != nil {
		return st, err
	}
	st.Progress = c.Seq
	if c.Includes(st.Seq) {
		err := p.finished(ctx, &st)
		return st, err
	}
	if st.goneUnrun() {
		st.State, st.Detail = JobRemovedUnrun, goneDetail
		return st, nil
	}
	snap, err := b.Snapshot(ctx)
	if err != nil {
		return st, err
	}
	for _, ps := range snap.Partitions {
		if ps.Partition == st.Partition && ps.Holder != "" && ps.Holder != "?" {
			st.Holder, st.Epoch = ps.Holder, ps.Epoch
		}
	}
	st.State = JobPending
	if st.Holder == "" {
		return st, nil
	}
	// Running when it is the partition's first job after the committed
	// progress. (A partition that runs several jobs at once runs later ones
	// too, and says nothing of which: they are pending until done.)
	s, err := p.jobs(ctx)
	if err != nil {
		return st, err
	}
	next, err := s.GetMsg(ctx, st.Progress+1, jetstream.WithGetMsgSubject(JobSubject(p.cfg.Prefix, st.Partition)))
	if err == nil && next.Sequence == st.Seq {
		st.State = JobRunning
	} else if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		return st, fmt.Errorf("worker: job status: %w", err)
	}
	return st, nil
}

func (p *Producer) bucket() (*coordinator.Bucket, error) {
	if p.cfg.Bucket == nil {
		return nil, errors.New("worker: job status needs the lease bucket: set ProducerConfig.Bucket")
	}
	return p.cfg.Bucket, nil
}

func (p *Producer) jobs(ctx context.Context) (jetstream.Stream, error) {
	s, err := p.js.Stream(ctx, JobsStream(p.cfg.Prefix))
	if err != nil {
		return nil, fmt.Errorf("worker: look up job stream %s: %w", JobsStream(p.cfg.Prefix), err)
	}
	return s, nil
}

// locate fills in the job's sequence in the job stream; for a delayed job
// not yet fired it answers JobScheduled. A state other than JobUnknown is
// final.
func (p *Producer) locate(ctx context.Context, ref Enqueued) (JobStatus, error) {
	st := JobStatus{Ref: ref.Ref(), ID: ref.ID, Partition: ref.Partition, Seq: ref.Seq, Due: ref.Due}
	if int(ref.Partition) >= p.cfg.Partitions || ref.Seq == 0 {
		return st, fmt.Errorf("worker: job %s: no such partition or sequence (the job stream has %d partitions)", st.Ref, p.cfg.Partitions)
	}
	s, err := p.jobs(ctx)
	if err != nil {
		return st, err
	}
	if ref.Due.IsZero() {
		return p.checkStored(ctx, s, st)
	}
	subject := ScheduleSubject(p.cfg.Prefix, ref.ID)
	sched, err := s.GetLastMsgForSubject(ctx, subject)
	switch {
	case err == nil && sched.Header.Get(hdrSchedule) != "":
		st.State = JobScheduled
		return st, nil
	case err != nil && !errors.Is(err, jetstream.ErrMsgNotFound):
		return st, fmt.Errorf("worker: job %s: read its schedule: %w", st.Ref, err)
	}
	// Fired: find the job the scheduler stored, from a second before its
	// due time on.
	found := uint64(0)
	err = scan(ctx, p.js, JobsStream(p.cfg.Prefix), JobSubject(p.cfg.Prefix, ref.Partition),
		jetstream.ConsumerConfig{DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: ptr(ref.Due.Add(-time.Second))},
		func(m jetstream.Msg, md *jetstream.MsgMetadata) bool {
			if firstValue(m.Headers(), hdrScheduler) == subject && firstValue(m.Headers(), HeaderJobID) == ref.ID {
				found = md.Sequence.Stream
				return false
			}
			return true
		})
	if err != nil {
		return st, fmt.Errorf("worker: job %s: find the job its schedule fired: %w", st.Ref, err)
	}
	if found == 0 {
		st.Detail = "its schedule is gone and no job it fired is in the job stream (trimmed, or the schedule was removed)"
		return st, nil
	}
	st.Seq = found
	return st, nil
}

// checkStored checks that the job stream holds, or held, partition
// st.Partition's job at st.Seq: a reference is user input, and the
// partition's progress passes the sequences of other partitions' jobs
// too. A job trimmed since cannot be checked and is taken as it is.
func (p *Producer) checkStored(ctx context.Context, s jetstream.Stream, st JobStatus) (JobStatus, error) {
	subject := JobSubject(p.cfg.Prefix, st.Partition)
	m, err := s.GetMsg(ctx, st.Seq)
	switch {
	case err == nil && m.Subject != subject:
		st.Detail = fmt.Sprintf("sequence %d of the job stream is a message on %s, not a job of partition %d", st.Seq, m.Subject, st.Partition)
	case err == nil:
	case errors.Is(err, jetstream.ErrMsgNotFound):
		info, err := s.Info(ctx)
		if err != nil {
			return st, fmt.Errorf("worker: job %s: %w", st.Ref, err)
		}
		if st.Seq > info.State.LastSeq {
			st.Detail = fmt.Sprintf("the job stream holds no sequence %d: its last is %d", st.Seq, info.State.LastSeq)
		}
		st.removed = true
	default:
		return st, fmt.Errorf("worker: job %s: read it: %w", st.Ref, err)
	}
	return st, nil
}

func ptr[T any](v T) *T { return &v }

// locateAt is the most jobs Wait locates at once.
const locateAt = 16

// located is a job's first location, for Wait.
type located struct {
	st  JobStatus
	err error
	ok  bool // not used yet
}

// locateAll locates refs, up to locateAt at once: one read each, which
// one after another cost Wait 1.6 s for 4,000 jobs. It returns nil for a
// few, which Wait locates as it goes.
func (p *Producer) locateAll(ctx context.Context, refs []Enqueued) []located {
	if len(refs) < 2*locateAt {
		return nil
	}
	out := make([]located, len(refs))
	next := make(chan int)
	var wg sync.WaitGroup
	for range locateAt {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				st, err := p.locate(ctx, refs[i])
				out[i] = located{st: st, err: err, ok: true}
			}
		}()
	}
	for i := range refs {
		next <- i
	}
	close(next)
	wg.Wait()
	return out
}

// maxReplays bounds the replays Wait follows from one job.
const maxReplays = 100

// Wait waits until every job of refs has finished (see JobState.Finished),
// or ctx ends, and returns their statuses in the order of refs. A job
// replayed from its dead letter is followed to its replay: Wait waits for
// the replay, whose status it returns, with JobStatus.Via naming the jobs
// replayed on the way (up to 100 replays; after them it returns the
// replayed status). It wakes on every change to the fence records (each
// progress commit), and polls with backoff beside that (up to a second
// between polls) for delayed jobs and for a watch that fails. Each round
// reads each partition's progress once, and the dead letters and records
// of a partition once for all its jobs found finished. On ctx's end it
// returns the statuses as they were and ctx's error.
func (p *Producer) Wait(ctx context.Context, refs ...Enqueued) ([]JobStatus, error) {
	b, err := p.bucket()
	if err != nil {
		return nil, err
	}
	wake := make(chan struct{}, 1)
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	if w, err := b.FenceRecords().WatchAll(wctx, jetstream.UpdatesOnly(), jetstream.MetaOnly()); err == nil {
		watched := make(chan struct{})
		defer func() {
			stop()
			_ = w.Stop()
			<-watched
		}()
		go func() {
			defer close(watched)
			for {
				select {
				case _, ok := <-w.Updates():
					if !ok {
						return
					}
					select {
					case wake <- struct{}{}:
					default:
					}
				case <-wctx.Done():
					return
				}
			}
		}()
	}
	refs = slices.Clone(refs) // followed replays replace them
	out := make([]JobStatus, len(refs))
	done := make([]bool, len(refs))
	located := make([]bool, len(refs))
	for i, r := range refs {
		out[i] = JobStatus{Ref: r.Ref(), ID: r.ID, Partition: r.Partition, Seq: r.Seq, Due: r.Due}
	}
	poll := 20 * time.Millisecond
	var finished []*JobStatus
	first := p.locateAll(ctx, refs)
	for {
		left := 0
		progress := map[leasehold.Partition]coordinator.Committed{}
		for i, r := range refs {
			if done[i] {
				continue
			}
			if !located[i] {
				var st JobStatus
				var err error
				if first != nil && first[i].ok {
					st, err = first[i].st, first[i].err
					first[i].ok = false
				} else {
					st, err = p.locate(ctx, r)
				}
				if err != nil {
					return out, err
				}
				st.Via = out[i].Via
				out[i] = st
				if st.State == JobScheduled {
					left++
					continue
				}
				if st.State == JobUnknown && st.Detail != "" {
					return out, fmt.Errorf("worker: wait for job %s: %s", st.Ref, st.Detail)
				}
				located[i] = true
			}
			pr, ok := progress[r.Partition]
			if !ok {
				if pr, err = b.PartitionCommitted(ctx, r.Partition); err != nil {
					return out, err
				}
				progress[r.Partition] = pr
			}
			out[i].Progress = pr.Seq
			if !pr.Includes(out[i].Seq) && out[i].goneUnrun() {
				out[i].State, out[i].Detail = JobRemovedUnrun, goneDetail
				done[i] = true
				continue
			}
			if !pr.Includes(out[i].Seq) {
				out[i].State = JobPending
				left++
				continue
			}
			finished = append(finished, &out[i])
			done[i] = true
		}
		if err := p.finished(ctx, finished...); err != nil {
			return out, err
		}
		finished = finished[:0]
		followed := false
		for i := range refs {
			if !done[i] || out[i].State != JobReplayed || len(out[i].Via) >= maxReplays {
				continue
			}
			next, err := ParseRef(out[i].ReplayedAs)
			if err != nil {
				continue // a record is checked when read; this cannot be
			}
			via := append(out[i].Via, out[i].Ref)
			refs[i] = next
			out[i] = JobStatus{Ref: next.Ref(), Partition: next.Partition, Seq: next.Seq, Via: via}
			done[i], located[i], followed = false, false, true
			left++
		}
		if left == 0 {
			return out, p.cancelsOf(ctx, refs, out)
		}
		if followed {
			continue
		}
		t := time.NewTimer(poll)
		select {
		case <-wake:
		case <-t.C:
			poll = min(2*poll, time.Second)
		case <-ctx.Done():
			t.Stop()
			return out, fmt.Errorf("worker: %d of %d jobs not finished: %w", left, len(refs), ctx.Err())
		}
		t.Stop()
	}
}
