package worker

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// Cancels. Producer.Cancel stores a record in the KV bucket
// "<prefix>-cancels" (CancelBucket), keyed by the job's partition and its
// sequence ("<p>.s<seq>"), or for a delayed job its ID's digest
// ("<p>.i<sha256>"), which the job it fires carries. A partition's runner
// reads its partition's keys before its first job, and follows their
// changes through the worker's one watch of the bucket (cancelfeed.go): a
// job with a record is not handed to its handler when its turn comes, and
// a running job's context is cancelled with the cause ErrJobCancelled.
// Either way the attempt's effects are aborted (its finals are never
// sent, so the sinks apply none of them), the runner writes into the
// record which job
// it cancelled under which epoch, and the job completes without effects:
// progress passes it and Status says JobCancelled. A handler that returns
// nil after its cancel arrived is cancelled all the same, as long as the
// runner has not sent its finals; one whose finals were sent is done.
//
// A record names one job, not every job at its key: a sequence record
// carries the time the job stream stored its job (a stream deleted and
// made again numbers its jobs from 1 again, and its new jobs are not the
// ones cancelled), and an ID record carries the delayed job's due time,
// which the job its schedule fires carries in HeaderDue (a later job with
// the same ID, delayed to another time or not delayed at all, is not the
// one cancelled). A record that does not name the job is ignored, by the
// runner and by Status, and a Cancel of the job there replaces it.
//
// A cancel is best effort against an attempt that has completed. Under
// one lease, a job whose finals were sent is done, and its cancel comes
// too late. Across a fail-over it cannot be told: a job stored before the
// successor took the partition, beyond the progress its predecessor
// committed, may have completed under the predecessor (its effects and
// finals are in the effect log, and sinks apply them) without its progress
// being committed. The successor skips it, and its outcome says so
// (cancelOutcome.Earlier): Status says cancelled, and its Detail that an
// attempt under an earlier epoch may have completed it.

// ErrJobCancelled is the cause of a cancelled job's context
// (context.Cause(ctx)), and is matched by what the cancelled attempt
// returns.
var ErrJobCancelled = errors.New("worker: the job was cancelled")

// ErrJobFinished is matched by the error of a Cancel of a job that has
// finished (done, dead-lettered, replayed, purged, removed unrun or
// cancelled already): there is nothing to cancel.
var ErrJobFinished = errors.New("worker: the job has finished")

// CancelBucket names the KV bucket of prefix's cancels:
// "<prefix>-cancels". ProvisionJobs creates it.
func CancelBucket(prefix string) string { return prefix + "-cancels" }

// cancelRecord is a cancel's value. Anyone allowed to write the bucket can
// write one: parseCancel checks it against its key.
type cancelRecord struct {
	Ref       string `json:"ref"`
	ID        string `json:"id,omitempty"`  // a delayed job's
	Due       int64  `json:"due,omitempty"` // a delayed job's due time, Unix seconds
	Partition uint32 `json:"partition"`
	Seq       uint64 `json:"seq"`
	// Stored is when the job stream stored the job (a job's, not a
	// delayed job's): the job at Seq is the one cancelled only if it was
	// stored then.
	Stored time.Time `json:"stored,omitzero"`
	At     time.Time `json:"at"`
	// Cancelled is written by the runner that skipped or stopped the job.
	Cancelled *cancelOutcome `json:"cancelled,omitempty"`
}

type cancelOutcome struct {
	Seq     uint64          `json:"seq"` // the job's sequence
	Epoch   leasehold.Epoch `json:"epoch"`
	Worker  string          `json:"worker"`
	Running bool            `json:"running"` // its handler had started
	// Earlier: the job was stored before Epoch's lease was taken, beyond
	// the progress it started from, so an attempt under an earlier epoch
	// may have completed it before the hand-off.
	Earlier bool `json:"earlier,omitempty"`
}

// cancelSkew is how much earlier than its job a cancel record of an older
// release (one without Stored) may have been written and still be taken
// for that job's: the clocks of the servers that lead the job stream and
// the bucket may differ by that much.
const cancelSkew = 2 * time.Second

// names reports whether rec, stored at key at created, names the job
// stored at seq of partition p at stored with headers h: see the package
// comment on cancels.
func (rec cancelRecord) names(prefix, key string, created time.Time, p leasehold.Partition, seq uint64, stored time.Time, h nats.Header) bool {
	if rec.ID != "" {
		if firstValue(h, hdrScheduler) != ScheduleSubject(prefix, rec.ID) || jobIDOf(h) != rec.ID {
			return false // not fired by the schedule of its ID
		}
		return rec.Due == 0 || firstValue(h, HeaderDue) == time.Unix(rec.Due, 0).UTC().Format(time.RFC3339)
	}
	if key != cancelSeqKey(p, seq) {
		return false
	}
	if !rec.Stored.IsZero() {
		return rec.Stored.Equal(stored)
	}
	return created.IsZero() || stored.IsZero() || !created.Before(stored.Add(-cancelSkew))
}

func cancelSeqKey(p leasehold.Partition, seq uint64) string {
	return p.String() + ".s" + strconv.FormatUint(seq, 10)
}

func cancelIDKey(p leasehold.Partition, id string) string {
	s := sha256.Sum256([]byte(id))
	return p.String() + ".i" + hex.EncodeToString(s[:])
}

// cancelKeyOf is the key a cancel of ref is stored under.
func cancelKeyOf(ref Enqueued) string {
	if !ref.Due.IsZero() {
		return cancelIDKey(ref.Partition, ref.ID)
	}
	return cancelSeqKey(ref.Partition, ref.Seq)
}

// parseCancel reads a cancel record strictly, checking it against its key
// and partition.
func parseCancel(p leasehold.Partition, key string, b []byte) (cancelRecord, error) {
	var r cancelRecord
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&r); err != nil {
		return r, err
	}
	if d.More() {
		return r, errors.New("data after the record")
	}
	if leasehold.Partition(r.Partition) != p {
		return r, fmt.Errorf("the record names partition %d", r.Partition)
	}
	switch {
	case r.ID != "":
		if validID(r.ID) != nil || cancelIDKey(p, r.ID) != key {
			return r, errors.New("its job ID does not match its key")
		}
		if r.Due < 0 {
			return r, errors.New("a negative due time")
		}
	case r.Due != 0:
		return r, errors.New("a due time without a job ID")
	case r.Seq == 0 || cancelSeqKey(p, r.Seq) != key:
		return r, errors.New("its sequence does not match its key")
	}
	return r, nil
}

// Cancel cancels the job ref: a waiting (or delayed) job is skipped when
// its turn comes, and a running job's context is cancelled with the cause
// ErrJobCancelled; its effects are not applied, and Status then says
// JobCancelled. It returns the job's status before the cancel. A job that
// has finished is not cancelled: the error matches ErrJobFinished. A
// cancel is stored until the bucket is purged (CancelBucket); cancelling a
// job twice is no error. Needs ProducerConfig.Bucket.
func (p *Producer) Cancel(ctx context.Context, ref Enqueued) (JobStatus, error) {
	st, err := p.Status(ctx, ref)
	if err != nil {
		return st, err
	}
	if st.State.Finished() {
		return st, fmt.Errorf("%w: job %s is %s: nothing to cancel", ErrJobFinished, st.Ref, st.State)
	}
	if st.State == JobUnknown {
		return st, fmt.Errorf("worker: job %s: %s", st.Ref, st.Detail)
	}
	kv, err := p.js.KeyValue(ctx, CancelBucket(p.cfg.Prefix))
	if err != nil {
		return st, fmt.Errorf("worker: cancel job %s: open the bucket %s (provision it with worker.ProvisionJobs or `leasehold init`): %w", st.Ref, CancelBucket(p.cfg.Prefix), err)
	}
	rec := cancelRecord{Ref: ref.Ref(), Partition: uint32(ref.Partition), Seq: ref.Seq, At: time.Now().UTC()}
	if !ref.Due.IsZero() {
		rec.ID, rec.Due = ref.ID, ref.Due.Unix()
	} else if rec.Stored, err = p.storedAt(ctx, ref); err != nil {
		return st, fmt.Errorf("worker: cancel job %s: %w", st.Ref, err)
	}
	val, _ := json.Marshal(rec)
	key := cancelKeyOf(ref)
	_, err = kv.Create(ctx, key, val)
	for range 3 {
		if err == nil || !casConflict(err) {
			break
		}
		// A record is there: this job's (a second cancel), or one of
		// another job at its key, which it replaces.
		var e jetstream.KeyValueEntry
		e, err = kv.Get(ctx, key)
		if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
			_, err = kv.Create(ctx, key, val)
			continue
		}
		if err != nil {
			break
		}
		if have, perr := parseCancel(ref.Partition, key, e.Value()); perr == nil && have.ID == rec.ID && have.Due == rec.Due && have.Stored.Equal(rec.Stored) {
			return st, nil
		}
		_, err = kv.Update(ctx, key, val, e.Revision())
	}
	if err != nil {
		return st, fmt.Errorf("worker: cancel job %s: %w", st.Ref, err)
	}
	return st, nil
}

// storedAt is when the job stream stored the job ref.
func (p *Producer) storedAt(ctx context.Context, ref Enqueued) (time.Time, error) {
	s, err := p.jobs(ctx)
	if err != nil {
		return time.Time{}, err
	}
	m, err := s.GetMsg(ctx, ref.Seq)
	if err != nil {
		return time.Time{}, fmt.Errorf("read the job: %w", err)
	}
	return m.Time, nil
}

// Status tells where the job ref is: scheduled, pending, running (by whom,
// at which epoch), done, dead-lettered, replayed (as which job), purged,
// removed unrun or cancelled. It reads the lease bucket and the fence
// records through the coordinator's read-only calls, the job and
// dead-letter streams (their dead letters and records, see Record) through
// the stream leader, and the cancels; it needs ProducerConfig.Bucket. A
// job whose cancel is requested and not carried out yet says so in
// Detail.
func (p *Producer) Status(ctx context.Context, ref Enqueued) (JobStatus, error) {
	st, err := p.status(ctx, ref)
	if err != nil {
		return st, err
	}
	sts := []JobStatus{st}
	err = p.cancelsOf(ctx, []Enqueued{ref}, sts)
	return sts[0], err
}

// cancelsOf tells which of the jobs refs, whose statuses are sts, were
// cancelled: a finished job the runner recorded as cancelled is
// JobCancelled, and an unfinished one with a cancel says so in Detail.
func (p *Producer) cancelsOf(ctx context.Context, refs []Enqueued, sts []JobStatus) error {
	kv, err := p.js.KeyValue(ctx, CancelBucket(p.cfg.Prefix))
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("worker: read the cancels: %w", err)
	}
	present, err := cancelKeysFor(ctx, kv, len(refs))
	if err != nil {
		return fmt.Errorf("worker: read the cancels: %w", err)
	}
	for i, ref := range refs {
		st := &sts[i]
		if int(ref.Partition) >= p.cfg.Partitions || st.State != JobDone && st.State.Finished() {
			continue
		}
		key := cancelKeyOf(ref)
		if present != nil && !present[key] {
			continue
		}
		e, err := kv.Get(ctx, key)
		if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
			continue
		}
		if err != nil {
			return fmt.Errorf("worker: job %s: read its cancel: %w", st.Ref, err)
		}
		rec, err := parseCancel(ref.Partition, key, e.Value())
		if err != nil {
			continue // not a cancel this producer wrote: it says nothing
		}
		if !ref.Due.IsZero() {
			if rec.Due != 0 && rec.Due != ref.Due.Unix() {
				continue // a cancel of another job with its ID
			}
		} else if stored, err := p.storedAt(ctx, ref); err == nil && !rec.names(p.cfg.Prefix, key, e.Created(), ref.Partition, ref.Seq, stored, nil) {
			continue // a cancel of a job that held its place before (its stream was made again)
		}
		switch {
		case rec.Cancelled != nil && st.State != JobScheduled && st.State != JobUnknown:
			// Pending or running: the runner has cancelled it, and its
			// progress will pass it.
			verb := "skipped"
			if rec.Cancelled.Running {
				verb = "stopped"
			}
			st.State = JobCancelled
			st.Detail = fmt.Sprintf("cancelled at %s; %s %s it under epoch %d", rec.At.Format(time.RFC3339), rec.Cancelled.Worker, verb, rec.Cancelled.Epoch)
			if rec.Cancelled.Earlier {
				st.Detail += ", but an attempt under an earlier epoch may have completed it before that hand-off, and sinks then applied its effects (its progress was not committed)"
			}
		case st.State != JobDone:
			st.Detail = "a cancel was requested at " + rec.At.Format(time.RFC3339) + "; it is skipped or stopped when its partition's worker sees it"
		}
	}
	return nil
}

// cancelKeysFor returns the keys of the cancels bucket kv when reading
// them all costs less than n reads of one key each (Producer.Wait asks
// for thousands of jobs at once, and most buckets hold few cancels, or
// none); nil when it does not, and each key is read on its own.
func cancelKeysFor(ctx context.Context, kv jetstream.KeyValue, n int) (map[string]bool, error) {
	if n <= 1 {
		return nil, nil
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, err
	}
	if st.Values() >= uint64(n) {
		return nil, nil
	}
	keys := map[string]bool{}
	if st.Values() == 0 {
		return keys, nil
	}
	l, err := kv.ListKeys(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = l.Stop() }()
	for k := range l.Keys() {
		keys[k] = true
	}
	return keys, nil
}

// provisionCancels creates the bucket of cancels, as durable as the
// streams: a lost cancel lets its job run.
func provisionCancels(ctx context.Context, js jetstream.JetStream, prefix string, replicas int) error {
	name := CancelBucket(prefix)
	_, err := js.KeyValue(ctx, name)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		_, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket: name, Description: "leasehold cancels: jobs to skip or stop, by partition and sequence or ID",
			History: 1, Storage: jetstream.FileStorage, Replicas: replicas,
		})
		if errors.Is(err, jetstream.ErrBucketExists) {
			err = nil
		}
	}
	if err != nil {
		return fmt.Errorf("worker: bucket of cancels %s: %w", name, err)
	}
	return nil
}
