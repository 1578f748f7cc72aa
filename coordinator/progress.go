package coordinator

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// FencedEpoch is the epoch partition p was last fenced under: the epoch of
// the newest acquisition that has started work, as its fence record says.
// It is 0 when the partition was never acquired. It is for display;
// IssuedEpoch is what a sink may trust.
func (b *Bucket) FencedEpoch(ctx context.Context, p leasehold.Partition) (leasehold.Epoch, error) {
	r, _, err := b.readFence(ctx, partitionKey(p))
	if err != nil {
		return 0, fmt.Errorf("coordinator: read the fence record of partition %d: %w", p, err)
	}
	return leasehold.Epoch(r.Epoch), nil
}

// Progress is the input sequence committed for partition p, as its fence
// record says.
func (b *Bucket) Progress(ctx context.Context, p leasehold.Partition) (uint64, error) {
	r, _, err := b.readFence(ctx, partitionKey(p))
	if err != nil {
		return 0, fmt.Errorf("coordinator: read the fence record of partition %d: %w", p, err)
	}
	return r.Seq, nil
}

// PartitionCommitted is what partition p's fence record says of its
// committed progress: the watermark and the jobs done beyond it (see
// Committed).
func (b *Bucket) PartitionCommitted(ctx context.Context, p leasehold.Partition) (Committed, error) {
	r, _, err := b.readFence(ctx, partitionKey(p))
	if err != nil {
		return Committed{}, fmt.Errorf("coordinator: read the fence record of partition %d: %w", p, err)
	}
	return Committed{Epoch: leasehold.Epoch(r.Epoch), Acquisition: r.Acquisition, Seq: r.Seq, Done: r.done}, nil
}

// fence rewrites the lease's fence record under its epoch and acquisition,
// so that no earlier holder can commit progress any more, and learns the
// sequence to resume after. A record fenced at a later epoch loses the
// lease; one fenced at the same epoch by another acquisition (the lease
// bucket handed one revision out twice) loses it too, as a split brain.
// repair rewrites a record that does not decode, or that claims an epoch
// above every revision the lease bucket has issued, instead of refusing.
func (l *Lease) fence(ctx context.Context, repair bool) error {
	if l.member {
		return nil
	}
	l.pmu.Lock()
	defer l.pmu.Unlock()
	if !repair && l.fenceFromHint(ctx) {
		return nil
	}
	epoch := uint64(l.info.Epoch)
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
		cur, rev, err := l.c.b.readFence(rctx, l.key)
		cancel()
		if errors.Is(err, errGarbledFence) {
			if !repair {
				return err
			}
			l.c.cfg.Logger.Warn("fence record does not decode: rewriting it; progress starts at the job stream's beginning", "lease", l.String(), "err", err)
			l.repaired = append(l.repaired, fmt.Sprintf("rewrote %s of bucket %s, which did not decode; progress starts at the job stream's beginning", l.key, l.c.b.fenceName))
			cur = fenceRecord{}
		} else if err != nil {
			lastErr = err
			continue
		}
		if cur.Epoch > epoch {
			if repair && l.neverIssued(ctx, cur.Epoch) {
				l.c.cfg.Logger.Warn("fence record claims an epoch the lease bucket never issued: rewriting it", "lease", l.String(), "claimed", cur.Epoch)
				l.repaired = append(l.repaired, fmt.Sprintf("rewrote %s of bucket %s, which claimed epoch %d, above every revision the lease bucket issued (its progress %d is kept)", l.key, l.c.b.fenceName, cur.Epoch, cur.Seq))
				cur.Epoch, cur.Recent, cur.Acquisitions, cur.Forgotten = 0, nil, nil, 0
			} else {
				return l.lose(LostRefused, cur.Holder, fmt.Errorf("%s is fenced at epoch %d already (by %s); if no acquisition issued it, the record was forged or the lease bucket lost writes: %s",
					l.key, cur.Epoch, cur.Holder, repairHint(l.key)))
			}
		}
		if cur.Epoch == epoch {
			if cur.Acquisition == l.info.Acquisition {
				// An earlier attempt of ours landed.
				l.fenceRev, l.fenced, l.progRead = rev, cur, true
				return nil
			}
			return l.lose(LostRefused, cur.Holder, fmt.Errorf("%w: epoch %d of %s is recorded for another acquisition (%s of %s): the lease bucket issued one revision twice (it lost acknowledged writes, or was restored from a copy); run NATS with sync_interval: always",
				leasehold.ErrSplitBrain, epoch, l.key, cur.Acquisition, cur.Holder))
		}
		next := cur.withEpoch(epoch, l.info.Acquisition, l.info.Holder)
		if l.kind != kindPartition {
			next.Seq, next.Done, next.done = 0, "", nil
		}
		rctx, cancel = context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
		nrev, err := l.c.b.putFence(rctx, l.key, next, rev)
		cancel()
		if err == nil {
			l.fenceRev, l.fenced, l.progRead, l.previous = nrev, next, true, cur
			return nil
		}
		lastErr = err
		if isRefusal(err) && !isConflict(err) {
			return err
		}
	}
	return fmt.Errorf("gave up: %w", lastErr)
}

// neverIssued reports whether epoch is above every revision the lease
// bucket has issued.
func (l *Lease) neverIssued(ctx context.Context, epoch uint64) bool {
	rctx, cancel := context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
	defer cancel()
	last, err := l.c.b.lastRevision(rctx)
	return err == nil && epoch > last
}

// fenceFromHint tries the fence once against the fence record as a direct
// get reads it. A direct get may be answered by a replica that is behind,
// but the write is a compare-and-set on the revision read, so it lands only
// if what was read is the record's current state; and a direct get is
// served by the stream, not queued behind the other JetStream API requests
// (consumer creations, when many partitions start at once) the way a read
// through the leader is. It reports whether the fence landed; when it did
// not, for whatever reason (a stale or missing record, a later epoch, no
// answer), fence settles it through the leader, as if the hint had not
// been tried: an unanswered write that landed shows up there as this
// lease's own acquisition.
func (l *Lease) fenceFromHint(ctx context.Context) bool {
	rctx, cancel := context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
	defer cancel()
	cur, next, rev, ok := l.hintedFence(rctx)
	if !ok {
		return false
	}
	nrev, err := l.c.b.putFence(rctx, l.key, next, rev)
	if err != nil {
		return false
	}
	l.fenceRev, l.fenced, l.progRead, l.previous = nrev, next, true, cur
	return true
}

// hintedFence reads l's fence record with a direct get, which a follower
// may answer, and returns it, the record that fences it at l's epoch, and
// the revision a write of that must expect (0: no record). ok is false
// when the read fails, or the record does not decode or holds l's epoch
// or a later one: the fence step's reads through the leader decide then.
func (l *Lease) hintedFence(ctx context.Context) (cur, next fenceRecord, rev uint64, ok bool) {
	switch e, err := l.c.b.fences.Get(ctx, l.key); {
	case errors.Is(err, jetstream.ErrKeyNotFound):
	case err != nil:
		return cur, next, 0, false
	default:
		r, err := decodeFence(e.Value())
		if err != nil || r.Epoch >= uint64(l.info.Epoch) {
			return cur, next, 0, false
		}
		cur, rev = r, e.Revision()
	}
	next = cur.withEpoch(uint64(l.info.Epoch), l.info.Acquisition, l.info.Holder)
	if l.kind != kindPartition {
		next.Seq, next.Done, next.done = 0, "", nil
	}
	return cur, next, rev, true
}

// Commit records that every input up to and including seq has been handled
// and its effects written, and so have the inputs in done above seq: a
// runner with several jobs in flight finishes them out of order, and done
// are those it finished beyond its watermark. Jobs in done at or below seq
// are dropped, and past MaxDone of them the lowest MaxDone are kept: seq
// moves only over jobs that are all finished, and a job left out is run
// again by a successor, under the same idempotency keys. It is a
// compare-and-set on the partition's fence record: once a later holder has
// fenced the partition, Commit returns an error matching
// leasehold.ErrLeaseLost and the record keeps the later holder's progress.
// Commit asks the server even when the lease looks lost locally: the
// server decides. A seq below the committed one, or the committed one with
// the same done jobs, is a no-op.
func (l *Lease) Commit(ctx context.Context, seq uint64, done ...uint64) error {
	if l.kind != kindPartition {
		return fmt.Errorf("coordinator: %s has no progress to commit", l)
	}
	l.pmu.Lock()
	defer l.pmu.Unlock()
	if !l.progRead {
		return errors.New("coordinator: Commit on a lease whose fence record was not written")
	}
	done = doneAbove(seq, done)
	if seq < l.fenced.Seq || seq == l.fenced.Seq && slices.Equal(done, l.fenced.done) {
		return nil
	}
	return l.setProgressDone(ctx, seq, done)
}

// Committed is the lease's committed progress, as of the acquisition
// (fenced under this lease's epoch) or the last Commit: a runner resumes
// after Seq and skips the jobs in Done.
func (l *Lease) Committed() Committed {
	l.pmu.Lock()
	defer l.pmu.Unlock()
	return Committed{Epoch: leasehold.Epoch(l.fenced.Epoch), Acquisition: l.fenced.Acquisition, Seq: l.fenced.Seq, Done: l.fenced.done}
}

// setProgress writes seq, with no job done beyond it, into the fence
// record, which must still be this lease's. l.pmu is held.
func (l *Lease) setProgress(ctx context.Context, seq uint64) error {
	return l.setProgressDone(ctx, seq, nil)
}

// setProgressDone writes seq and done (ascending, above seq, at most
// MaxDone) into the fence record, which must still be this lease's. l.pmu
// is held.
func (l *Lease) setProgressDone(ctx context.Context, seq uint64, done []uint64) error {
	next := l.fenced
	next.Seq, next.Done, next.done = seq, encodeDone(seq, done), done
	var err error
	wait := false // the last refusal was of a write still being stored
	start := time.Now()
	for attempt := range commitTries {
		if attempt > 0 && time.Since(start) > 3*l.c.cfg.RequestTimeout {
			// A server that does not answer is not waited on longer than
			// three unanswered tries.
			break
		}
		if wait {
			// The record read back does not show the write in flight yet.
			select {
			case <-ctx.Done():
				return fmt.Errorf("coordinator: commit progress %d of %s: %w (last error: %v)", seq, l, ctx.Err(), err)
			case <-timeAfter(backoff(attempt)):
			}
		}
		rctx, cancel := context.WithTimeout(ctx, l.c.cfg.RequestTimeout)
		var rev uint64
		rev, err = l.c.b.putFence(rctx, l.key, next, l.fenceRev)
		cancel()
		if err == nil {
			l.fenceRev, l.fenced = rev, next
			return nil
		}
		if isRefusal(err) && !isConflict(err) {
			break
		}
		// Refused by revision, or no answer: read the record back.
		rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), l.c.cfg.RequestTimeout)
		cur, crev, rerr := l.c.b.readFence(rctx, l.key)
		cancel()
		if rerr != nil {
			err = fmt.Errorf("%w (reading the fence record back: %v)", err, rerr)
			wait = true
			continue
		}
		if cur.Epoch != next.Epoch || cur.Acquisition != next.Acquisition {
			lerr := l.lose(LostRefused, cur.Holder, fmt.Errorf("commit progress %d: %s fenced at epoch %d", seq, l.key, cur.Epoch))
			return &LostError{Lease: l.info, Reason: LostRefused, Holder: cur.Holder, Err: lerr.Err}
		}
		wait = isInFlight(err) || crev == l.fenceRev
		l.fenceRev, l.fenced = crev, cur
		if cur.Seq == seq && cur.Done == next.Done {
			return nil
		}
	}
	return fmt.Errorf("coordinator: commit progress %d of %s: gave up after %v: %w", seq, l, time.Since(start).Round(time.Millisecond), err)
}

// MaxDone bounds the jobs a fence record keeps as finished beyond its
// committed progress (Committed.Done).
const MaxDone = 1024

// doneAbove is done without the jobs at or below seq, ascending and
// distinct, at most MaxDone of them (the lowest).
func doneAbove(seq uint64, done []uint64) []uint64 {
	if len(done) == 0 {
		return nil
	}
	if !slices.IsSorted(done) {
		done = slices.Sorted(slices.Values(done))
	}
	i, _ := slices.BinarySearch(done, seq+1)
	out := slices.Compact(slices.Clone(done[i:]))
	if len(out) > MaxDone {
		out = out[:MaxDone]
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// The jobs a record keeps as finished beyond Seq are encoded as their
// distances, each from the one before and the first from Seq, as unsigned
// varints in unpadded base64 (URL alphabet), as members list their
// holdings: 1024 jobs a few sequences apart take about 1.4 KB.

// encodeDone encodes done, ascending and above seq; nil gives "".
func encodeDone(seq uint64, done []uint64) string {
	if len(done) == 0 {
		return ""
	}
	buf := make([]byte, 0, len(done)*2)
	prev := seq
	for _, d := range done {
		buf = binary.AppendUvarint(buf, d-prev)
		prev = d
	}
	return base64.RawURLEncoding.EncodeToString(buf)
}

// decodeDone decodes what encodeDone wrote for seq. It checks what it
// reads, as it comes from the network: canonical varints, every job above
// the one before and Seq, no sequence past 2^63, and at most MaxDone jobs.
func decodeDone(seq uint64, s string) ([]uint64, error) {
	if len(s) > base64.RawURLEncoding.EncodedLen(MaxDone*binary.MaxVarintLen64) {
		return nil, fmt.Errorf("done: %d characters, more than %d jobs take", len(s), MaxDone)
	}
	// The decoder skips line breaks; nothing else may.
	if i := strings.IndexFunc(s, func(c rune) bool {
		return !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_')
	}); i >= 0 {
		return nil, fmt.Errorf("done: %q is not in base64's URL alphabet", s[i])
	}
	buf, err := base64.RawURLEncoding.Strict().DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("done: %v", err)
	}
	var out []uint64
	prev := seq
	for len(buf) > 0 {
		d, k := binary.Uvarint(buf)
		if k <= 0 || k != uvarintLen(d) {
			return nil, errors.New("done: a number that does not end, or is not written in its shortest form")
		}
		buf = buf[k:]
		if d == 0 || d > 1<<63 || prev > 1<<63-d {
			return nil, fmt.Errorf("done: a job at or below %d, or past 2^63", prev)
		}
		if len(out) == MaxDone {
			return nil, fmt.Errorf("done: more than %d jobs", MaxDone)
		}
		prev += d
		out = append(out, prev)
	}
	return out, nil
}

// uvarintLen is the length of d as binary.AppendUvarint writes it.
func uvarintLen(d uint64) int {
	n := 1
	for ; d >= 0x80; d >>= 7 {
		n++
	}
	return n
}

// commitTries bounds setProgress's writes, as releaseTries bounds
// Release's purges, and so does three times RequestTimeout in all: a
// write refused because an earlier one to the record is still being
// stored (an answer lost, a busy replicated bucket) is tried again after
// a backoff, which over 8 tries waits 0.95 to 1.9 s in all. Three tries,
// waiting 30 to 60 ms, ran out on a busy machine while an R3 bucket with
// sync still stored the earlier write.
const commitTries = 8
