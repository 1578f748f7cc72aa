package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

var errGarbledProgress = errors.New("progress record is not leasehold's JSON")

// readProgress reads a partition's progress record from the stream leader.
// It returns the record and the revision to compare against (0 when the key
// holds no message).
func (b *Bucket) readProgress(ctx context.Context, p leasehold.Partition) (progressRecord, uint64, error) {
	e, err := b.last(ctx, progressKey(p))
	if err != nil {
		return progressRecord{}, 0, err
	}
	switch e.kind {
	case entryNone:
		return progressRecord{}, 0, nil
	case entryMarker:
		return progressRecord{}, e.rev, nil
	}
	var r progressRecord
	if err := json.Unmarshal(e.data, &r); err != nil {
		return progressRecord{}, 0, fmt.Errorf("%w: partition %d: %v: fix the key %s (its seq is the last input handled)", errGarbledProgress, p, err, progressKey(p))
	}
	return r, e.rev, nil
}

// IssuedEpoch is the highest epoch the bucket issued for fence id: for
// now the epoch under which the partition's progress was last fenced. It
// is 0 when the partition was never acquired, and an error for a scope the
// bucket does not serve.
func (b *Bucket) IssuedEpoch(ctx context.Context, id leasehold.FenceID) (leasehold.Epoch, error) {
	if id.Scope != b.scope {
		return 0, fmt.Errorf("coordinator: lease bucket %s issues epochs for scope %q, not %q", b.name, b.scope, id.Scope)
	}
	return b.FencedEpoch(ctx, id.Partition)
}

// FencedEpoch is the epoch under which partition p's progress was last
// fenced: the epoch of the newest acquisition that has started work. It is
// 0 when the partition was never acquired.
func (b *Bucket) FencedEpoch(ctx context.Context, p leasehold.Partition) (leasehold.Epoch, error) {
	r, _, err := b.readProgress(ctx, p)
	if err != nil {
		return 0, fmt.Errorf("coordinator: read progress of partition %d: %w", p, err)
	}
	return leasehold.Epoch(r.Epoch), nil
}

// fenceProgress rewrites the progress record under this lease's epoch, so
// that no earlier holder can commit progress any more; it learns the
// sequence to resume after.
func (l *Lease) fenceProgress(ctx context.Context) error {
	l.pmu.Lock()
	defer l.pmu.Unlock()
	key := progressKey(l.info.Partition)
	if l.fenceFromHint(ctx, key) {
		return nil
	}
	var lastErr error
	for attempt := 0; attempt < 8; attempt++ {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-l.ctx.Done():
				return context.Cause(l.ctx)
			case <-timeAfter(backoff(attempt)):
			}
		}
		rctx, cancel := context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
		cur, rev, err := l.c.b.readProgress(rctx, l.info.Partition)
		cancel()
		if errors.Is(err, errGarbledProgress) {
			return err
		}
		if err != nil {
			lastErr = err
			continue
		}
		if cur.Epoch > uint64(l.info.Epoch) {
			return l.lose(LostRefused, cur.Holder, fmt.Errorf("progress already fenced at epoch %d", cur.Epoch))
		}
		if cur.Epoch == uint64(l.info.Epoch) {
			// An earlier attempt of ours landed.
			l.progRev, l.progSeq, l.progRead = rev, cur.Seq, true
			return nil
		}
		next, _ := json.Marshal(progressRecord{Epoch: uint64(l.info.Epoch), Seq: cur.Seq, Holder: l.info.Holder})
		rctx, cancel = context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
		nrev, err := l.c.b.put(rctx, key, next, rev, 0)
		cancel()
		if err == nil {
			l.progRev, l.progSeq, l.progRead = nrev, cur.Seq, true
			return nil
		}
		lastErr = err
		if isRefusal(err) && !isConflict(err) {
			return err
		}
	}
	return fmt.Errorf("gave up: %w", lastErr)
}

// fenceFromHint tries the fence once against the progress record as a
// direct get reads it. A direct get may be answered by a replica that is
// behind, but the write is a compare-and-set on the revision read, so it
// lands only if what was read is the record's current state; and a direct
// get is served by the stream, not queued behind the other JetStream API
// requests (consumer creations, when many partitions start at once) the
// way a read through the leader is. It reports whether the fence landed;
// when it did not, for whatever reason (a stale or missing record, a
// later epoch, no answer), fenceProgress settles it through the leader, as
// if the hint had not been tried: an unanswered write that landed shows up
// there as this lease's own epoch.
func (l *Lease) fenceFromHint(ctx context.Context, key string) bool {
	rctx, cancel := context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
	defer cancel()
	var (
		cur progressRecord
		rev uint64 // 0: no record, which the write checks too
	)
	switch e, err := l.c.b.kv.Get(rctx, key); {
	case errors.Is(err, jetstream.ErrKeyNotFound):
	case err != nil:
		return false
	default:
		if json.Unmarshal(e.Value(), &cur) != nil || cur.Epoch >= uint64(l.info.Epoch) {
			return false
		}
		rev = e.Revision()
	}
	next, _ := json.Marshal(progressRecord{Epoch: uint64(l.info.Epoch), Seq: cur.Seq, Holder: l.info.Holder})
	nrev, err := l.c.b.put(rctx, key, next, rev, 0)
	if err != nil {
		return false
	}
	l.progRev, l.progSeq, l.progRead = nrev, cur.Seq, true
	return true
}

// Commit records that every input up to and including seq has been handled
// and its effects written. It is a compare-and-set on the progress record:
// once a later holder has fenced the partition, Commit returns an error
// matching leasehold.ErrLeaseLost and the record keeps the later holder's
// progress. Commit asks the server even when the lease looks lost locally:
// the server decides. A seq at or below the committed one is a no-op.
func (l *Lease) Commit(ctx context.Context, seq uint64) error {
	if l.member {
		return errors.New("coordinator: a membership lease has no progress")
	}
	l.pmu.Lock()
	defer l.pmu.Unlock()
	if !l.progRead {
		return errors.New("coordinator: Commit on a lease whose progress was not fenced")
	}
	if seq <= l.progSeq {
		return nil
	}
	key := progressKey(l.info.Partition)
	next, _ := json.Marshal(progressRecord{Epoch: uint64(l.info.Epoch), Seq: seq, Holder: l.info.Holder})
	var err error
	for range 3 {
		rctx, cancel := context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
		var rev uint64
		rev, err = l.c.b.put(rctx, key, next, l.progRev, 0)
		cancel()
		if err == nil {
			l.progRev, l.progSeq = rev, seq
			return nil
		}
		if isRefusal(err) && !isConflict(err) {
			break
		}
		// Refused by revision, or no answer: read the record back.
		rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), l.c.cfg.RequestTimeout)
		cur, crev, rerr := l.c.b.readProgress(rctx, l.info.Partition)
		cancel()
		if rerr != nil {
			err = fmt.Errorf("%w (reading progress back: %v)", err, rerr)
			continue
		}
		if cur.Epoch != uint64(l.info.Epoch) {
			lerr := l.lose(LostRefused, cur.Holder, fmt.Errorf("commit progress %d: partition fenced at epoch %d", seq, cur.Epoch))
			return &LostError{Lease: l.info, Reason: LostRefused, Holder: cur.Holder, Err: lerr.Err}
		}
		l.progRev, l.progSeq = crev, cur.Seq
		if cur.Seq >= seq {
			return nil
		}
	}
	return fmt.Errorf("coordinator: commit progress %d of %s: %w", seq, l, err)
}
