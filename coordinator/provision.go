package coordinator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/internal/retry"
)

// wallClock is the clock Provision reads for a new bucket's first revision; a
// variable so that tests can set it behind the real one.
var wallClock = time.Now

// Provision creates the lease bucket and its fence-record bucket if they
// do not exist, and checks them if they do. Running it again, or on two
// machines at once, is safe.
//
// A new lease bucket gets per-key TTLs with limit markers, a history of
// one, file storage, and a first revision (its first epoch) above the
// current time in Unix microseconds, above every epoch the fence-record
// bucket recorded, and above EpochFloor. Deleting the lease bucket and
// provisioning it again, from any machine whatever its clock, therefore
// never lowers an epoch, and progress carries over. When the fence records
// are gone as well while the job stream <scope>-jobs has been used,
// Provision refuses: nothing left says which epochs were issued or how far
// each partition got. Set EpochFloor to the highest epoch a sink recorded
// and RestartProgress to accept that progress starts at the job stream's
// beginning.
//
// A lease bucket made by an earlier leasehold, which kept progress records
// in itself, is upgraded in place: its progress.<p> records are copied into
// the fence-record bucket and replaced by a value earlier workers refuse to
// read, so that an earlier worker still running fails loudly instead of
// committing progress nobody reads.
func Provision(ctx context.Context, js jetstream.JetStream, cfg BucketConfig) (*Bucket, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	s, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Stream, error) { return js.Stream(ctx, "KV_"+cfg.Bucket) })
	switch {
	case err == nil:
		if err := upgrade(ctx, js, s, cfg); err != nil {
			return nil, err
		}
	case errors.Is(err, jetstream.ErrStreamNotFound):
		if err := create(ctx, js, cfg); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("coordinator: look up lease bucket %s: %w", cfg.Bucket, err)
	}
	return open(ctx, js, cfg.Bucket, cfg.Replicas)
}

// fenceBucketOf is the fence-record bucket cfg names, or the default.
func fenceBucketOf(cfg BucketConfig) string {
	if cfg.FenceBucket != "" {
		return cfg.FenceBucket
	}
	return FenceBucketName(cfg.Bucket)
}

// create makes a new lease bucket next to its fence-record bucket, above
// every epoch that bucket recorded.
func create(ctx context.Context, js jetstream.JetStream, cfg BucketConfig) error {
	fences := fenceBucketOf(cfg)
	first := uint64(wallClock().UnixMicro())
	var floor leasehold.Epoch
	_, err := js.Stream(ctx, "KV_"+fences)
	switch {
	case err == nil:
		if _, err := ensureFenceBucket(ctx, js, fences, cfg.Bucket, cfg.Scope, cfg.Replicas); err != nil {
			return err
		}
		if err := updateStream(ctx, js, "KV_"+fences, nil, cfg); err != nil {
			return err
		}
		start := time.Now()
		highest, n, err := fenceFloor(ctx, js, fences)
		if err != nil {
			return err
		}
		floor = highest
		cfg.Logger.Info("lease bucket is missing; its fence records carry over", "bucket", cfg.Bucket, "fence_bucket", fences,
			"records", n, "highest_epoch", highest, "read_in", time.Since(start).Round(time.Millisecond))
	case errors.Is(err, jetstream.ErrStreamNotFound):
		if err := refuseLostFences(ctx, js, cfg, "the lease bucket "+cfg.Bucket+" and its fence-record bucket "+fences+" are both missing", true); err != nil {
			return err
		}
		if _, err := ensureFenceBucket(ctx, js, fences, cfg.Bucket, cfg.Scope, cfg.Replicas); err != nil {
			return err
		}
	default:
		return fmt.Errorf("coordinator: look up fence-record bucket %s: %w", fences, err)
	}
	first = max(first, uint64(floor)+1, uint64(cfg.EpochFloor)+1)
	_, err = createStream(ctx, js, jetstream.StreamConfig{
		Name:                   "KV_" + cfg.Bucket,
		Description:            "leasehold leases and members; fence records are in " + fences,
		Subjects:               []string{"$KV." + cfg.Bucket + ".>"},
		MaxMsgsPerSubject:      1,
		MaxMsgs:                -1,
		MaxBytes:               -1,
		MaxMsgSize:             -1,
		MaxConsumers:           -1,
		Storage:                jetstream.FileStorage,
		Replicas:               cfg.Replicas,
		AllowRollup:            true,
		DenyDelete:             true,
		AllowDirect:            true,
		Discard:                jetstream.DiscardNew,
		Duplicates:             2 * time.Minute,
		AllowMsgTTL:            true,
		SubjectDeleteMarkerTTL: cfg.MarkerTTL,
		AllowAtomicPublish:     true,
		FirstSeq:               first,
		Metadata:               map[string]string{metaKind: "lease-bucket", metaScope: cfg.Scope, metaFences: fences},
	})
	if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return fmt.Errorf("coordinator: create lease bucket %s: %w", cfg.Bucket, err)
	}
	if err == nil {
		cfg.Logger.Debug("lease bucket created", "bucket", cfg.Bucket, "scope", cfg.Scope, "fence_bucket", fences, "first_epoch", first)
	}
	return nil
}

// upgrade checks an existing lease bucket, records its scope if an earlier
// leasehold made it, and gives it a fence-record bucket, moving its
// progress records there.
func upgrade(ctx context.Context, js jetstream.JetStream, s jetstream.Stream, cfg BucketConfig) error {
	sc := s.CachedInfo().Config
	if err := checkStream(cfg.Bucket, sc, cfg.Replicas); err != nil {
		return err
	}
	meta := map[string]string{}
	if err := adoptScope(ctx, js, sc, cfg); err != nil {
		return err
	} else if sc.Metadata[metaScope] == "" {
		meta[metaScope] = cfg.Scope
	}
	fences := sc.Metadata[metaFences]
	switch {
	case fences != "" && cfg.FenceBucket != "" && cfg.FenceBucket != fences:
		return fmt.Errorf("%w: lease bucket %s keeps its fence records in %s, not %s", ErrBucketConfig, cfg.Bucket, fences, cfg.FenceBucket)
	case fences != "":
		// Progress lives in the fence-record bucket already: it must be
		// there still.
		_, err := js.Stream(ctx, "KV_"+fences)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			if err := refuseLostFences(ctx, js, cfg, "the fence-record bucket "+fences+" of lease bucket "+cfg.Bucket+" is missing", false); err != nil {
				return err
			}
			cfg.Logger.Warn("fence-record bucket was missing: progress starts again at the job stream's beginning", "bucket", cfg.Bucket, "fence_bucket", fences)
		} else if err != nil {
			return fmt.Errorf("coordinator: look up fence-record bucket %s: %w", fences, err)
		}
		if _, err := ensureFenceBucket(ctx, js, fences, cfg.Bucket, cfg.Scope, sc.Replicas); err != nil {
			return err
		}
	default:
		fences = fenceBucketOf(cfg)
		if _, err := ensureFenceBucket(ctx, js, fences, cfg.Bucket, cfg.Scope, sc.Replicas); err != nil {
			return err
		}
		moved, err := moveProgress(ctx, js, cfg.Bucket, fences)
		if err != nil {
			return err
		}
		cfg.Logger.Info("moved progress records to the fence-record bucket", "bucket", cfg.Bucket, "fence_bucket", fences, "records", moved)
		meta[metaFences] = fences
	}
	if err := updateStream(ctx, js, "KV_"+fences, nil, cfg); err != nil {
		return err
	}
	return updateStream(ctx, js, "KV_"+cfg.Bucket, meta, cfg)
}

// updateStream adds meta to stream's metadata and lets it take atomic
// batches, which acquisitions use when both buckets do (batch.go), if it
// does not have them yet. Every update a Provision makes to a stream is
// this one, all changes at once: of two Provisions running together, each
// writes the whole of what they both want, so neither undoes the other's.
// A server that does not know atomic batches (before nats-server 2.12)
// leaves them off, and acquisitions go one by one.
func updateStream(ctx context.Context, js jetstream.JetStream, stream string, meta map[string]string, cfg BucketConfig) error {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return fmt.Errorf("coordinator: update %s: %w", stream, err)
	}
	sc := s.CachedInfo().Config
	changed := !sc.AllowAtomicPublish
	if sc.Metadata == nil {
		sc.Metadata = map[string]string{}
	}
	for k, v := range meta {
		changed = changed || sc.Metadata[k] != v
		sc.Metadata[k] = v
	}
	if !changed {
		return nil
	}
	atomic := sc.AllowAtomicPublish
	sc.AllowAtomicPublish = true
	s, err = js.UpdateStream(ctx, sc)
	if err != nil {
		return fmt.Errorf("coordinator: update %s: %w", stream, err)
	}
	if !atomic && s.CachedInfo().Config.AllowAtomicPublish {
		cfg.Logger.Info("allowed atomic batches, which acquisitions of many partitions use", "stream", stream)
	}
	return nil
}

// refuseLostFences refuses to go on without fence records when the job
// stream of cfg.Scope has been used, unless cfg accepts what is lost.
// needFloor says whether the epochs were lost too (the lease bucket is
// gone as well), so that a floor is needed.
func refuseLostFences(ctx context.Context, js jetstream.JetStream, cfg BucketConfig, what string, needFloor bool) error {
	jobs := jobsStream(cfg.Scope)
	s, err := js.Stream(ctx, jobs)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil // a new deployment
	}
	if err != nil {
		return fmt.Errorf("coordinator: look up job stream %s: %w", jobs, err)
	}
	st := s.CachedInfo().State
	if st.LastSeq == 0 {
		return nil // never used
	}
	if cfg.RestartProgress && (!needFloor || cfg.EpochFloor > 0) {
		return nil
	}
	msg := fmt.Sprintf("%s, but job stream %s has been used (it holds %d jobs, last sequence %d): the records of how far each partition got are lost",
		what, jobs, st.Msgs, st.LastSeq)
	if needFloor {
		msg += ", and so are the epochs the lease bucket issued. Pass an epoch floor, the highest epoch any sink has recorded for scope " + cfg.Scope +
			" (BucketConfig.EpochFloor, `leasehold init --epoch-floor`), so that new epochs start above it and sinks do not refuse the new holders as stale;"
	} else {
		msg += " (epochs are safe: they continue from the lease bucket's revisions)."
	}
	msg += " Progress will start again at the job stream's beginning, and its jobs run again: accept that with BucketConfig.RestartProgress (`leasehold init --restart-progress`)"
	return fmt.Errorf("%w: %s", ErrBucketConfig, msg)
}

// adoptScope checks that an existing bucket serves cfg.Scope. A bucket
// created before scopes were recorded is checked against the key an
// earlier leasehold wrote; upgrade then records the scope.
func adoptScope(ctx context.Context, js jetstream.JetStream, sc jetstream.StreamConfig, cfg BucketConfig) error {
	if got := sc.Metadata[metaScope]; got != "" {
		if got != cfg.Scope {
			return fmt.Errorf("%w: bucket %s serves scope %q, not %q: give each job stream its own lease bucket (by default \"<prefix>-leases\"), since leases and progress are kept per partition number",
				ErrBucketConfig, cfg.Bucket, got, cfg.Scope)
		}
		return nil
	}
	// An earlier leasehold recorded the job stream in a key of the bucket.
	if e, err := legacyOwner(ctx, js, cfg.Bucket); err != nil {
		return err
	} else if e != "" && e != cfg.Scope {
		return fmt.Errorf("%w: bucket %s serves job stream %q, not %q: give each job stream its own lease bucket",
			ErrBucketConfig, cfg.Bucket, e, cfg.Scope)
	}
	return nil
}

// legacyOwner reads the "jobstream" key an earlier leasehold wrote.
func legacyOwner(ctx context.Context, js jetstream.JetStream, bucket string) (string, error) {
	m, err := leader.NewReader(js, "KV_"+bucket).Last(ctx, "$KV."+bucket+".jobstream")
	if err != nil {
		return "", fmt.Errorf("coordinator: read the job stream of lease bucket %s: %w", bucket, err)
	}
	if m == nil || leader.IsMarker(m.Header) {
		return "", nil
	}
	return string(m.Data), nil
}
