package chaos

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// forgeCopies sends, for a real effect of a job, an abort marker of the
// same job and attempt, and a final of a higher attempt with the real
// stamp, claiming one effect.
func (f *forger) forgeCopies(ctx context.Context, e seenEffect) {
	st := e.stamp
	st.Key = abortKey(st, e.mark.Job, e.mark.Attempt)
	abort := leasehold.JobMark{Job: e.mark.Job, Attempt: e.mark.Attempt, Abort: true}
	f.publish(ctx, forgedMsg(e.subject, st, abort, nil), ForgedAbortCopy, st, abort)

	f.mu.Lock()
	after := f.lastJob[chain{e.stamp.Partition, e.stamp.Epoch, e.stamp.Acquisition}]
	f.mu.Unlock()
	if after >= e.mark.Job {
		after = 0
	}
	final := leasehold.JobMark{Job: e.mark.Job, Attempt: min(e.mark.Attempt+1, leasehold.MaxAttempt), Effects: 1, After: after}
	f.publish(ctx, forgedMsg(e.subject, e.stamp, final, f.payload(ForgedFinalCopy)), ForgedFinalCopy, e.stamp, final)
}

// forgeAbortAhead sends abort markers with the largest attempt for the
// next jobs of a partition, before they run, under the stamp of its live
// holder. It prefers a partition whose holder publishes effects of jobs
// (marks they carry are the ones an abort closes).
func (f *forger) forgeAbortAhead(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	f.mu.Lock()
	var cands []seenEffect
	for _, e := range f.latest {
		cands = append(cands, e)
	}
	f.rnd.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	// A partition whose newest effect carries its job's marks is held by a
	// worker that marks every job (Job.Emit): its next job is one an abort
	// can close.
	slices.SortStableFunc(cands, func(a, b seenEffect) int {
		am, bm := f.progress[a.stamp.Partition] == a.mark.Job, f.progress[b.stamp.Partition] == b.mark.Job
		switch {
		case am && !bm:
			return -1
		case bm && !am:
			return 1
		}
		return 0
	})
	pick := f.rnd.IntN(f.h.cfg.Partitions)
	f.mu.Unlock()
	var st leasehold.Stamp
	for _, e := range cands {
		a, ok := f.holderOf(rctx, e.stamp.Partition)
		if ok && a.epoch == e.stamp.Epoch && a.token == e.stamp.Acquisition {
			st = e.stamp
			break
		}
	}
	if st.Scope == "" {
		a, ok := f.holderOf(rctx, leasehold.Partition(pick))
		if !ok {
			f.h.log.Info("chaos: forger: no holder to forge an abort ahead for", "partition", pick)
			return
		}
		st = leasehold.Stamp{Scope: prefix, Partition: a.p, Epoch: a.epoch, Acquisition: a.token, Worker: a.holder}
	}
	f.mu.Lock()
	progress := f.progress[st.Partition]
	f.mu.Unlock()
	jobs := f.jobsAhead(rctx, st.Partition, progress)
	if len(jobs) == 0 {
		f.h.log.Info("chaos: forger: no job ahead to forge an abort for", "partition", st.Partition)
	}
	for _, job := range jobs {
		mark := leasehold.JobMark{Job: job, Attempt: leasehold.MaxAttempt, Abort: true}
		st.Key = abortKey(st, job, mark.Attempt)
		f.publish(ctx, forgedMsg(worker.OutputSubject(prefix, st.Partition), st, mark, nil), ForgedAbortAhead, st, mark)
	}
}

// holderOf reads partition p's live lease from the lease bucket.
func (f *forger) holderOf(ctx context.Context, p leasehold.Partition) (seenAcq, bool) {
	e, err := f.kv.Get(ctx, "partition."+p.String())
	if err != nil {
		return seenAcq{}, false
	}
	var r leaseRecord
	if json.Unmarshal(e.Value(), &r) != nil || r.Token == "" {
		return seenAcq{}, false
	}
	epoch := r.Epoch
	if epoch == 0 {
		epoch = e.Revision()
	}
	return seenAcq{p: p, epoch: leasehold.Epoch(epoch), token: r.Token, holder: r.Holder}, true
}

// jobsAhead returns the next two jobs of partition p after job seq: those
// in the job stream, or, when none is there yet, the sequences the
// producer's round robin gives p next.
func (f *forger) jobsAhead(ctx context.Context, p leasehold.Partition, seq uint64) []uint64 {
	s, err := f.js.Stream(ctx, worker.JobsStream(prefix))
	if err != nil {
		f.h.log.Warn("chaos: forger: job stream", "err", err)
		return nil
	}
	var out []uint64
	for len(out) < 2 {
		m, err := s.GetMsg(ctx, seq+1, jetstream.WithGetMsgSubject(worker.JobSubject(prefix, p)))
		if err != nil {
			break
		}
		out, seq = append(out, m.Sequence), m.Sequence
	}
	if len(out) > 0 {
		return out
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.LastSeq == 0 {
		return nil
	}
	last, err := s.GetMsg(ctx, info.State.LastSeq)
	if err != nil {
		return nil
	}
	lp, err := leasehold.ParsePartition(last.Subject[strings.LastIndexByte(last.Subject, '.')+1:])
	if err != nil {
		return nil
	}
	n := uint64(f.h.cfg.Partitions)
	d := (uint64(p) + n - uint64(lp)) % n
	if d == 0 {
		d = n
	}
	next := info.State.LastSeq + d
	return []uint64{next, next + n}
}

// liveAcquisition is the acquisition of a partition with a live holder,
// read from the lease bucket now.
func (f *forger) liveAcquisition(ctx context.Context) (seenAcq, bool) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	f.mu.Lock()
	start := f.rnd.IntN(f.h.cfg.Partitions)
	f.mu.Unlock()
	for i := range f.h.cfg.Partitions {
		if a, ok := f.holderOf(rctx, leasehold.Partition((start+i)%f.h.cfg.Partitions)); ok {
			return a, true
		}
	}
	return seenAcq{}, false
}

// madeUpToken is an acquisition token no acquisition wrote, shaped as
// real ones are.
func (f *forger) madeUpToken() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var b [12]byte
	for i := range b {
		b[i] = byte(f.rnd.Uint32())
	}
	return hex.EncodeToString(b[:])
}

// forgeAcquisition sends, for partition a.p just acquired at a.epoch, an
// effect stamped with an epoch issued to another fence between a.p's
// previous epoch and a.epoch, then a barrier and an effect with a.epoch
// and a made-up acquisition token.
func (f *forger) forgeAcquisition(ctx context.Context, a seenAcq, lock seenAcq) {
	subject := worker.OutputSubject(prefix, a.p)
	if foreign, ok := f.foreignEpoch(ctx, a, lock); ok {
		st := leasehold.Stamp{Scope: prefix, Partition: a.p, Epoch: foreign.epoch, Acquisition: foreign.token,
			Key: fmt.Sprintf("%s.%d.forged-foreign.%d", prefix, a.p, f.nonce()), Worker: a.holder}
		f.publish(ctx, forgedMsg(subject, st, leasehold.JobMark{}, f.payload(ForgedForeignEpoch)), ForgedForeignEpoch, st, leasehold.JobMark{})
	}
	token := f.madeUpToken()
	st := leasehold.Stamp{Scope: prefix, Partition: a.p, Epoch: a.epoch, Acquisition: token,
		Key: leasehold.BarrierKey(prefix, a.p, a.epoch), Worker: a.holder}
	msg := forgedMsg(subject, st, leasehold.JobMark{}, nil)
	msg.Header.Set(leasehold.HeaderBarrier, "1")
	f.publish(ctx, msg, ForgedAcqBarrier, st, leasehold.JobMark{})
	st.Key = fmt.Sprintf("%s.%d.forged-acquisition.%d", prefix, a.p, f.nonce())
	f.publish(ctx, forgedMsg(subject, st, leasehold.JobMark{}, f.payload(ForgedAcqEffect)), ForgedAcqEffect, st, leasehold.JobMark{})
}

// fenceRecord is what the forger reads of a fence record: the epochs of
// the partition's latest acquisitions.
type fenceRecord struct {
	Epoch  uint64   `json:"epoch"`
	Recent []uint64 `json:"recent"`
}

// epochsOf returns the epochs partition p's fence record lists.
func (f *forger) epochsOf(ctx context.Context, p leasehold.Partition) []leasehold.Epoch {
	if f.fences == nil {
		return nil
	}
	e, err := f.fences.Get(ctx, "partition."+p.String())
	if err != nil {
		return nil
	}
	var r fenceRecord
	if json.Unmarshal(e.Value(), &r) != nil {
		return nil
	}
	var out []leasehold.Epoch
	for _, v := range append(r.Recent, r.Epoch) {
		if v != 0 {
			out = append(out, leasehold.Epoch(v))
		}
	}
	return out
}

// foreignEpoch is an acquisition of another fence (another partition, or
// the lock) whose epoch lies between a.p's epoch before a and a's. What
// the forger saw acquired comes first; the fence records fill in what it
// did not see.
func (f *forger) foreignEpoch(ctx context.Context, a, lock seenAcq) (seenAcq, bool) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	f.mu.Lock()
	var prev leasehold.Epoch
	for _, x := range f.acqs[a.p] {
		if x.epoch < a.epoch {
			prev = x.epoch
		}
	}
	f.mu.Unlock()
	if prev == 0 {
		for _, e := range f.epochsOf(rctx, a.p) {
			if e < a.epoch {
				prev = max(prev, e)
			}
		}
	}
	if prev == 0 {
		return seenAcq{}, false
	}
	recorded := map[leasehold.Partition][]leasehold.Epoch{}
	for q := range f.h.cfg.Partitions {
		if leasehold.Partition(q) != a.p {
			recorded[leasehold.Partition(q)] = f.epochsOf(rctx, leasehold.Partition(q))
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var cands []seenAcq
	for q, es := range recorded {
		for _, e := range es {
			if e > prev && e < a.epoch {
				// The token is not in the record the forger reads; it
				// copies the holder's, as if the acquisition were its.
				cands = append(cands, seenAcq{p: q, epoch: e, token: a.token, holder: a.holder})
			}
		}
	}
	if lock.epoch > prev && lock.epoch < a.epoch {
		cands = append(cands, lock)
	}
	for _, x := range f.allAcqs {
		if x.p != a.p && x.epoch > prev && x.epoch < a.epoch {
			cands = append(cands, x)
		}
	}
	if len(cands) == 0 {
		return seenAcq{}, false
	}
	return cands[f.rnd.IntN(len(cands))], true
}

// forgeMarkers is the fault's injection, from the nemesis.
func (h *harness) forgeMarkers(ctx context.Context) error {
	if h.forger == nil {
		return errors.New("the forger is not running")
	}
	h.forger.arm(ctx)
	return nil
}
