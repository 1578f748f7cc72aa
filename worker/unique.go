package worker

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
)

// Unique jobs. The stream's duplicate window drops a repeated Nats-Msg-Id
// for a few minutes; a unique job holds for a period the producer chooses,
// across producers and server restarts, in a KV bucket of its own
// ("<prefix>-unique", see UniqueBucket): the key is a digest of the job's
// kind and payload (Unique) or of a key the producer gives (UniqueKey),
// and its value names the job stored first. The entry carries a per-key
// TTL of the period, so uniqueness ends when the period does, whatever
// became of the job (done, dead-lettered, cancelled or still waiting).
//
// An enqueue reserves the key (create if absent), stores the job, then
// records the job's place in the reservation (a compare-and-set on the
// reservation's revision). A producer that dies between the two leaves a
// reservation without a place; another producer takes it over once it is
// older than uniqueReserveFor, so a crash does not block the key for the
// whole period (it may let a second copy in, should the dead producer's
// job have been stored).

// UniqueBucket names the KV bucket of prefix's unique jobs:
// "<prefix>-unique". ProvisionJobs creates it (nats-server 2.11 or later).
func UniqueBucket(prefix string) string { return prefix + "-unique" }

// ErrDuplicateJob is matched by the error of an enqueue refused because a
// job of the same uniqueness (Unique, UniqueKey) was enqueued within its
// period. errors.As to *DuplicateJobError gives that job.
var ErrDuplicateJob = errors.New("worker: a job with the same uniqueness is enqueued already")

// DuplicateJobError names the job that holds a uniqueness.
type DuplicateJobError struct {
	// Existing is the job enqueued first. Its Seq is 0 while another
	// producer is still storing it (Partition and ID are known then).
	Existing Enqueued
	// Until is when the uniqueness ends, as far as this producer can tell
	// (the reservation's time plus the period asked for now).
	Until time.Time
}

func (e *DuplicateJobError) Error() string {
	if e.Existing.Seq == 0 {
		return fmt.Sprintf("worker: a job with the same uniqueness (ID %s, partition %d) is being enqueued by another producer; not enqueued again", e.Existing.ID, e.Existing.Partition)
	}
	return fmt.Sprintf("worker: a job with the same uniqueness is enqueued already as %s (ID %s); not enqueued again until about %s", e.Existing.Ref(), e.Existing.ID, e.Until.UTC().Format(time.RFC3339))
}

// Is matches ErrDuplicateJob.
func (e *DuplicateJobError) Is(target error) bool { return target == ErrDuplicateJob }

// uniqueness is what Unique or UniqueKey asked for.
type uniqueness struct {
	key    string // the producer's key; "" for kind and payload
	period time.Duration
}

// Unique makes the job unique by its kind and payload for period: an
// enqueue of the same kind and payload (of the typed Enqueue: the same
// encoded value) before period has passed since the first is refused
// with an error matching ErrDuplicateJob that names the first job. The
// period runs from the enqueue whatever becomes of the job: done,
// dead-lettered or cancelled jobs keep their uniqueness until it ends.
// It holds across producers and server restarts; it needs the bucket
// ProvisionJobs creates (UniqueBucket) and nats-server 2.11 or later. The
// period is rounded up to whole seconds.
func Unique(period time.Duration) EnqueueOption {
	return func(o *enqueueOpts) { o.unique = &uniqueness{period: period} }
}

// UniqueKey is Unique by key instead of kind and payload: jobs enqueued
// with the same key within period are stored once.
func UniqueKey(key string, period time.Duration) EnqueueOption {
	return func(o *enqueueOpts) { o.unique = &uniqueness{key: key, period: period} }
}

// uniqueRecord is a unique key's value: the reservation, and once the job
// is stored, its place.
type uniqueRecord struct {
	ID        string `json:"id"`
	Partition uint32 `json:"partition"`
	Seq       uint64 `json:"seq,omitempty"`
	Due       int64  `json:"due,omitempty"` // a delayed job's due time, Unix seconds
}

// uniqueName is the KV key of a uniqueness: the hex SHA-256 of its parts,
// each prefixed by its length so that no two inputs share one.
func uniqueName(u *uniqueness, kind string, data []byte) string {
	h := sha256.New()
	part := func(b []byte) {
		var n [8]byte
		for i := range n {
			n[i] = byte(uint64(len(b)) >> (8 * i))
		}
		h.Write(n[:])
		h.Write(b)
	}
	if u.key != "" {
		part([]byte("key"))
		part([]byte(u.key))
	} else {
		part([]byte("kind"))
		part([]byte(kind))
		part(data)
	}
	return "u." + hex.EncodeToString(h.Sum(nil))
}

// uniqueReserveFor is how old a reservation without a stored job must be
// before another producer takes it over: longer than an enqueue's retries.
func (p *Producer) uniqueReserveFor() time.Duration {
	return max(time.Second, 2*time.Duration(p.cfg.Retries+1)*p.cfg.AckTimeout)
}

// uniqueKV opens the bucket of unique jobs once.
func (p *Producer) uniqueKV(ctx context.Context) (jetstream.KeyValue, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.uniq != nil {
		return p.uniq, nil
	}
	// A JetStream API request on a cluster can go unanswered (one that
	// reaches a stream between leaders): each try is bounded, and tried
	// again as an enqueue's publish is.
	var kv jetstream.KeyValue
	err := p.tried(ctx, func(ctx context.Context) (err error) {
		kv, err = p.js.KeyValue(ctx, UniqueBucket(p.cfg.Prefix))
		return err
	})
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("worker: unique jobs need the bucket %s: run worker.ProvisionJobs (or `leasehold init`) on nats-server 2.11 or later", UniqueBucket(p.cfg.Prefix))
	}
	if err != nil {
		return nil, fmt.Errorf("worker: open the bucket of unique jobs %s: %w", UniqueBucket(p.cfg.Prefix), err)
	}
	p.uniq = kv
	return kv, nil
}

// enqueueUnique reserves the job's uniqueness, stores the job, and records
// where it went.
func (p *Producer) enqueueUnique(ctx context.Context, part leasehold.Partition, data []byte, o enqueueOpts) (Enqueued, error) {
	u := o.unique
	if u.period < time.Second {
		return Enqueued{}, fmt.Errorf("worker: enqueue: a unique job's period is %v: use a second or more", u.period)
	}
	if len(u.key) > leasehold.MaxKeyLen {
		return Enqueued{}, fmt.Errorf("worker: enqueue: a unique key of %d bytes is over the limit of %d", len(u.key), leasehold.MaxKeyLen)
	}
	if err := validID(o.id); err != nil {
		return Enqueued{}, err
	}
	kv, err := p.uniqueKV(ctx)
	if err != nil {
		return Enqueued{}, err
	}
	name := uniqueName(u, o.kind, data)
	rev, err := p.reserve(ctx, kv, name, uniqueRecord{ID: o.id, Partition: uint32(part)}, u.period)
	if err != nil {
		return Enqueued{}, err
	}
	e, err := p.enqueueTo(ctx, part, data, o)
	if err != nil {
		// Not stored (as far as this producer knows): free the key.
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.AckTimeout)
		_ = kv.Purge(pctx, name, jetstream.LastRevision(rev), jetstream.PurgeTTL(time.Second))
		cancel()
		return Enqueued{}, err
	}
	rec := uniqueRecord{ID: e.ID, Partition: uint32(e.Partition), Seq: e.Seq}
	if !e.Due.IsZero() {
		rec.Due = e.Due.Unix()
	}
	val, _ := json.Marshal(rec)
	last := p.tried(ctx, func(ctx context.Context) error {
		_, err := p.js.PublishMsg(ctx, &nats.Msg{Subject: "$KV." + UniqueBucket(p.cfg.Prefix) + "." + name, Data: val},
			jetstream.WithExpectLastSequencePerSubject(rev), jetstream.WithMsgTTL(ttlSeconds(u.period)))
		return err
	})
	if last != nil {
		return e, fmt.Errorf("worker: job %s is stored, but recording it as its uniqueness's job failed, so a copy may be enqueued once the reservation is %v old: %w", e.Ref(), p.uniqueReserveFor(), last)
	}
	return e, nil
}

// reserve creates the unique key, or takes over a reservation without a
// job that is older than uniqueReserveFor, or one of its own job ID (its
// retry). Otherwise it returns a *DuplicateJobError.
func (p *Producer) reserve(ctx context.Context, kv jetstream.KeyValue, name string, rec uniqueRecord, period time.Duration) (uint64, error) {
	val, _ := json.Marshal(rec)
	subject := "$KV." + UniqueBucket(p.cfg.Prefix) + "." + name
	var last error
	start := time.Now()
	attempt := 0
	for ; attempt < minReserveTries || time.Since(start) < p.cfg.AckTimeout; attempt++ {
		if attempt > 0 {
			// On a cluster, a write of the key that the stream leader has
			// not applied yet refuses this one (error 10164) while a read
			// finds nothing: it is given time to apply, up to an ack's
			// timeout in all.
			if err := sleep(ctx, min(p.retryWait(attempt), maxReserveWait)); err != nil {
				return 0, fmt.Errorf("worker: reserve a unique job: %w (last error: %v)", err, last)
			}
		}
		cctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
		rev, err := kv.Create(cctx, name, val, jetstream.KeyTTL(ttlSeconds(period)))
		cancel()
		if err == nil {
			return rev, nil
		}
		if retryable(ctx, err) {
			// Stored or not: tried again, a create it stored is this
			// job's own reservation, taken over below (so is a take-over
			// whose answer was lost).
			last = err
			continue
		}
		if !casConflict(err) {
			return 0, fmt.Errorf("worker: reserve a unique job: %w", err)
		}
		// Through the stream leader: a follower answering a direct get
		// may not hold the create that refused this one yet.
		gctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
		entry, err := leader.NewReader(p.js, "KV_"+UniqueBucket(p.cfg.Prefix)).Last(gctx, subject)
		cancel()
		if err != nil {
			if retryable(ctx, err) {
				last = fmt.Errorf("read a unique job's reservation: %w", err)
				continue
			}
			return 0, fmt.Errorf("worker: read a unique job's reservation: %w", err)
		}
		if entry == nil || leader.IsMarker(entry.Header) {
			last = errors.New("the key was freed or expired in between, or a write of it is not applied yet")
			continue
		}
		if ttl := entry.Header.Get(jetstream.MsgTTLHeader); ttl == "" || ttl == "never" {
			// Every entry an enqueue writes carries the period as its TTL:
			// one without is no producer's, and would hold the key for
			// ever. Refuse it for as long as a stranger's reservation,
			// then take it over.
			if age := time.Since(entry.Time); age < p.uniqueReserveFor() {
				return 0, fmt.Errorf("%w: the bucket %s holds %s without a TTL, which no producer writes; it is taken over in %v", ErrDuplicateJob, UniqueBucket(p.cfg.Prefix), name, (p.uniqueReserveFor() - age).Round(time.Second))
			}
			rev, err := p.takeOver(ctx, subject, entry.Seq, val, period)
			if err == nil {
				p.untimedTaken(ctx, name, entry)
				return rev, nil
			}
			if !casConflict(err) && !retryable(ctx, err) {
				return 0, fmt.Errorf("worker: take over a unique job's entry without a TTL: %w", err)
			}
			last = err
			continue
		}
		have, err := p.parseUnique(entry.Data)
		if err != nil {
			// Not a record an enqueue wrote: it holds the key all the same.
			return 0, fmt.Errorf("%w: the bucket %s holds %s, which is not a unique job's record (%v); it ends with its TTL", ErrDuplicateJob, UniqueBucket(p.cfg.Prefix), name, err)
		}
		if have.Seq != 0 || (have.ID != rec.ID && time.Since(entry.Time) < p.uniqueReserveFor()) {
			dup := &DuplicateJobError{Existing: Enqueued{Partition: leasehold.Partition(have.Partition), Seq: have.Seq, ID: have.ID}, Until: entry.Time.Add(period)}
			if have.Due != 0 {
				dup.Existing.Due = time.Unix(have.Due, 0)
			}
			return 0, dup
		}
		// A reservation its producer gave up on (or this job's own):
		// take it over.
		rev, err = p.takeOver(ctx, subject, entry.Seq, val, period)
		if err == nil {
			return rev, nil
		}
		if !casConflict(err) && !retryable(ctx, err) {
			return 0, fmt.Errorf("worker: take over a unique job's reservation: %w", err)
		}
		last = err
	}
	return 0, fmt.Errorf("worker: reserve a unique job: its key kept changing, %d tries in %v: %w", attempt, time.Since(start).Round(time.Millisecond), last)
}

// tried runs f under a timeout of AckTimeout, and again after an answer
// lost or late (see transientPublish), up to Retries more times, waiting
// RetryWait, doubling, between tries. It returns f's last error.
func (p *Producer) tried(ctx context.Context, f func(context.Context) error) error {
	var err error
	for attempt := 0; attempt <= p.cfg.Retries; attempt++ {
		if attempt > 0 {
			if sleep(ctx, p.retryWait(attempt)) != nil {
				break
			}
		}
		actx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
		err = f(actx)
		cancel()
		if !retryable(ctx, err) {
			break
		}
	}
	return err
}

// retryable reports whether a request of a unique enqueue that failed with
// err is tried again: its answer was lost or late, and ctx has not ended.
func retryable(ctx context.Context, err error) bool {
	return transientPublish(err) && ctx.Err() == nil
}

// A reservation is tried at least minReserveTries times, and for at least
// an ack's timeout, waiting up to maxReserveWait between tries.
const (
	minReserveTries = 5
	maxReserveWait  = 500 * time.Millisecond
)

// takeOver replaces the unique key's entry at seq with val, if it is still
// the last, and returns the new revision.
func (p *Producer) takeOver(ctx context.Context, subject string, seq uint64, val []byte, period time.Duration) (uint64, error) {
	actx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
	defer cancel()
	ack, err := p.js.PublishMsg(actx, &nats.Msg{Subject: subject, Data: val},
		jetstream.WithExpectLastSequencePerSubject(seq), jetstream.WithMsgTTL(ttlSeconds(period)))
	if err != nil {
		return 0, err
	}
	return ack.Sequence, nil
}

// untimedTaken reports that the entry of the unique key name, written
// without a TTL (by hand, or by a credential that may write the bucket),
// was taken over: on the enqueue's span and in the log, since whoever
// wrote it may try again.
func (p *Producer) untimedTaken(ctx context.Context, name string, entry *leader.Msg) {
	trace.SpanFromContext(ctx).AddEvent("leasehold.unique.untimed_taken_over", trace.WithAttributes(attribute.String("leasehold.unique.key", name)))
	slog.Default().Warn("a unique job's key held an entry without a TTL, which no producer writes; taken over",
		"bucket", UniqueBucket(p.cfg.Prefix), "key", name, "written", entry.Time, "value", truncate(string(entry.Data), 200))
}

// truncate cuts s to at most n bytes, for a log line.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// parseUnique reads a unique key's value strictly: anyone allowed to
// write the bucket could have written it.
func (p *Producer) parseUnique(b []byte) (uniqueRecord, error) {
	var r uniqueRecord
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&r); err != nil {
		return uniqueRecord{}, err
	}
	if d.More() {
		return uniqueRecord{}, errors.New("data after the record")
	}
	if r.ID == "" || validID(r.ID) != nil {
		return uniqueRecord{}, errors.New("no valid job ID")
	}
	if int(r.Partition) >= p.cfg.Partitions {
		return uniqueRecord{}, fmt.Errorf("partition %d out of range", r.Partition)
	}
	if r.Due < 0 {
		return uniqueRecord{}, errors.New("a negative due time")
	}
	return r, nil
}

// casConflict reports whether err is a compare-and-set refusal: 10071 on
// one replica, mostly 10164 on three, unmapped for raw publishes.
func casConflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == 10071 || apiErr.ErrorCode == 10164)
}

// ttlSeconds rounds d up to whole seconds, at least one: the server's unit
// for per-message TTLs.
func ttlSeconds(d time.Duration) time.Duration {
	return max(time.Second, (d + time.Second - 1).Truncate(time.Second))
}

// provisionUnique creates the bucket of unique jobs, or checks that the
// one there keeps per-key TTLs. Its durability is the streams': a lost
// entry would let a copy in.
func provisionUnique(ctx context.Context, js jetstream.JetStream, prefix string, replicas int) error {
	name := UniqueBucket(prefix)
	kv, err := js.KeyValue(ctx, name)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket: name, Description: "leasehold unique jobs: the first job of each uniqueness, for its period",
			History: 1, Storage: jetstream.FileStorage, Replicas: replicas, LimitMarkerTTL: time.Second,
		})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = js.KeyValue(ctx, name)
		}
	}
	if err != nil {
		return fmt.Errorf("worker: bucket of unique jobs %s: %w", name, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return fmt.Errorf("worker: bucket of unique jobs %s: %w", name, err)
	}
	if st.LimitMarkerTTL() == 0 {
		return fmt.Errorf("%w: bucket %s has no per-key TTLs (LimitMarkerTTL), so uniqueness would never end; delete it and provision again", ErrStreamConfig, name)
	}
	return nil
}
