package worker

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
)

// A job that ages out of the job stream (JobsConfig.MaxAge) before its
// partition reaches it never runs, and once a later job's progress passes
// its sequence nothing would tell it from a job that ran and was trimmed.
// So the fetcher, about to hand over a job beyond the sequence it expected
// next, looks whether the sequences between are gone from the head of the
// job stream (its first sequence, as the stream leader answers, lies past
// them): those of them that were this partition's jobs were removed unrun,
// and a RecordRemoved for the range goes to the dead-letter stream before
// the job is handed over, so before progress can pass the range. One
// record a gap; a range that holds other partitions' jobs too says nothing
// false of this partition's.
//
// Sequences between two jobs of a partition are most often other
// partitions' jobs, so the fetcher does not ask the stream at every one:
// it asks for the first job it hands over (the partition may have waited
// for a holder for long), and after that only when the job before was
// stored so long ago that the sequences after it may have aged out. A job
// deleted by hand from the middle of the stream, or from its head while
// this fetcher runs, is not seen; nor, where workers trim committed jobs
// (Config.TrimCommitted) and the stream has no MaxAge, is a head the trims
// of other partitions moved (nothing else removes jobs there).

// gapState is what the fetcher knows for gap checks.
type gapState struct {
	last   time.Time     // stored time of the last job handed over
	maxAge time.Duration // the job stream's MaxAge, as last read; -1 before
}

// newGapState starts from the job stream's settings as Run read them.
func (r *runner) newGapState() gapState {
	g := gapState{maxAge: -1}
	if s := r.w.jobs; s != nil {
		g.maxAge = s.CachedInfo().Config.MaxAge
	}
	return g
}

// gapDue reports whether the jobs before one stored now may be gone.
func (g *gapState) gapDue() bool {
	switch {
	case g.last.IsZero() || g.maxAge < 0:
		return true
	case g.maxAge == 0:
		return false
	}
	margin := min(g.maxAge/2, time.Minute) // the server's clock is not ours
	return time.Since(g.last) >= g.maxAge-margin
}

// checkGap is called before the fetcher hands over the job md when it
// expected next: it records the removed range, if any. An error leaves
// the job unhanded: the fetcher reads it again, and checks again.
func (f *fetcher) checkGap(ctx context.Context, next uint64, md *nats.MsgMetadata) error {
	seq := md.Sequence.Stream
	cfg := &f.r.w.cfg
	if seq <= next || !f.gaps.gapDue() || f.gaps.maxAge == 0 && cfg.TrimCommitted {
		return nil
	}
	s, err := cfg.JetStream.Stream(ctx, JobsStream(cfg.Prefix)) // the leader's answer
	if err != nil {
		return fmt.Errorf("read the job stream's first sequence: %w", err)
	}
	info := s.CachedInfo()
	f.gaps.maxAge = info.Config.MaxAge
	first := info.State.FirstSeq
	if first <= next || info.Config.MaxAge == 0 && cfg.TrimCommitted {
		return nil
	}
	rec := Record{Kind: RecordRemoved, Partition: f.r.p, From: next, To: min(first, seq) - 1}
	sctx, cancel := context.WithTimeout(ctx, cfg.EffectTimeout)
	defer cancel()
	if _, err := StoreRecord(sctx, cfg.JetStream, cfg.Prefix, rec); err != nil {
		f.r.log.Warn("the jobs removed from the job stream before they ran could not be recorded; the partition waits until they are", "from", rec.From, "to", rec.To, "err", err)
		return err
	}
	f.r.log.Warn("the job stream removed sequences before this partition reached them (aged out, or purged): any of its jobs among them never ran, and their status says removed unrun",
		"from", rec.From, "to", rec.To, "next_job", seq, "max_age", info.Config.MaxAge)
	return nil
}
