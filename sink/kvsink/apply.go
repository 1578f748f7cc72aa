package kvsink

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// maxEffects bounds one Apply: each effect takes two messages of an
// atomic batch, and the server caps a batch at 1000 messages by default.
const maxEffects = 400

// Apply writes the effects in one atomic batch if every one is admitted.
func (s *Sink) Apply(ctx context.Context, effects ...sink.Effect) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("kvsink: apply: %w", err)
	}
	ctx, span := s.rep.StartApply(ctx, effects)
	defer span.End()
	if i, err := sink.ValidateEffects(effects); err != nil {
		if i >= 0 {
			s.rep.Report(ctx, sink.Decision{Outcome: sink.BadStamp, Stamp: effects[i].Stamp, Subject: effects[i].Subject, Err: err})
		}
		return err
	}
	if len(effects) > maxEffects {
		return fmt.Errorf("kvsink: apply: %d effects in one batch; the limit is %d: split the batch", len(effects), maxEffects)
	}
	for i := range effects {
		if err := checkSubject(&effects[i]); err != nil {
			s.rep.Report(ctx, sink.Decision{Outcome: sink.Failed, Stamp: effects[i].Stamp, Subject: effects[i].Subject, Err: err})
			return err
		}
	}
	parts := partitionsOf(effects)
	fences, err := s.fencesFor(ctx, parts, false)
	if err != nil {
		return s.failed(ctx, effects[0], err)
	}
	for i := range effects {
		if err := s.check.CheckAbove(ctx, effects[i].Stamp, fences[effects[i].Stamp.Partition].Epoch); err != nil {
			o := sink.Failed
			if errors.Is(err, sink.ErrUnverifiedEpoch) {
				o = sink.Unverified
			}
			s.rep.Report(ctx, sink.Decision{Outcome: o, Stamp: effects[i].Stamp, Subject: effects[i].Subject, Err: err})
			return err
		}
	}
	dup := make([]bool, len(effects))
	for attempt := 0; ; attempt++ {
		// Judge against the fences as the batch would leave them. A cached
		// fence is never above the server's, so a refusal against it is
		// final.
		next := make(map[leasehold.Partition]fence, len(parts))
		for i := range effects {
			st := effects[i].Stamp
			f, ok := next[st.Partition]
			if !ok {
				f = fences[st.Partition]
			}
			if st.Epoch < f.Epoch {
				serr := sink.StaleError(st, f.Epoch, f.Holder)
				s.rep.Report(ctx, sink.Decision{Outcome: sink.Stale, Stamp: st, Subject: effects[i].Subject, Max: f.Epoch, Holder: f.Holder, Err: serr})
				if len(effects) > 1 {
					return fmt.Errorf("kvsink: effect %d of %d: %w (no effect of the batch was applied)", i+1, len(effects), serr)
				}
				return serr
			}
			next[st.Partition] = fence{Epoch: st.Epoch, Holder: st.Worker, rev: f.rev}
		}
		msgs := s.batch(effects, dup, parts, next)
		seq, err := s.publishBatch(ctx, msgs)
		if err == nil {
			s.mu.Lock()
			for j, p := range parts {
				f := next[p]
				f.rev = seq - uint64(len(msgs)-1) + uint64(j)
				if f.rev > s.fences[p].rev {
					s.fences[p] = f
				}
			}
			s.mu.Unlock()
			for i := range effects {
				o := sink.Accepted
				if dup[i] {
					o = sink.Duplicate
				}
				s.rep.Report(ctx, sink.Decision{Outcome: o, Stamp: effects[i].Stamp, Subject: effects[i].Subject, Max: next[effects[i].Stamp.Partition].Epoch})
			}
			return nil
		}
		if !retryable(err) {
			return s.failed(ctx, effects[0], err)
		}
		// Another writer moved a fence or applied a key first, or the
		// answer was lost: read both again and decide again.
		if ctx.Err() != nil {
			return s.failed(ctx, effects[0], fmt.Errorf("%w (last attempt: %v)", ctx.Err(), err))
		}
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return s.failed(ctx, effects[0], fmt.Errorf("%w (last attempt: %v)", ctx.Err(), err))
			case <-time.After(backoff(attempt)):
			}
		}
		if fences, err = s.fencesFor(ctx, parts, true); err != nil {
			return s.failed(ctx, effects[0], err)
		}
		if err := s.readDedupe(ctx, effects, dup); err != nil {
			return s.failed(ctx, effects[0], err)
		}
	}
}

// batch builds the messages of one atomic batch: each partition's fence,
// written only over the revision read, then each effect's dedupe key,
// written only if new, and its value. Effects known to be duplicates
// contribute nothing but their fence.
func (s *Sink) batch(effects []sink.Effect, dup []bool, parts []leasehold.Partition, next map[leasehold.Partition]fence) []*nats.Msg {
	msgs := make([]*nats.Msg, 0, len(parts)+2*len(effects))
	for _, p := range parts {
		f := next[p]
		body, _ := json.Marshal(f)
		m := nats.NewMsg(s.prefix + fenceKey(p))
		m.Data = body
		m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(f.rev, 10))
		msgs = append(msgs, m)
	}
	seen := make(map[string]bool, len(effects))
	for i := range effects {
		e := &effects[i]
		if seen[e.Stamp.Key] {
			dup[i] = true
		}
		seen[e.Stamp.Key] = true
		if dup[i] {
			continue
		}
		d := nats.NewMsg(s.prefix + dedupeKey(e.Stamp.Key))
		d.Data = []byte(e.Stamp.Key)
		d.Header.Set(jetstream.ExpectedLastSubjSeqHeader, "0")
		if s.cfg.DedupeTTL > 0 {
			d.Header.Set(jetstream.MsgTTLHeader, strconv.Itoa(int(s.cfg.DedupeTTL/time.Second))+"s")
		}
		v := nats.NewMsg(s.prefix + e.Subject)
		v.Data = e.Data
		for k, vs := range e.Header {
			v.Header[k] = append([]string(nil), vs...)
		}
		e.Stamp.SetHeader(v.Header)
		msgs = append(msgs, d, v)
	}
	return msgs
}

// publishBatch publishes msgs as one atomic batch and returns the stream
// sequence of the last one.
func (s *Sink) publishBatch(ctx context.Context, msgs []*nats.Msg) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	var id [16]byte
	_, _ = rand.Read(id[:])
	batchID := hex.EncodeToString(id[:])
	nc := s.js.Conn()
	for i, m := range msgs {
		m.Header.Set("Nats-Batch-Id", batchID)
		m.Header.Set("Nats-Batch-Sequence", strconv.Itoa(i+1))
		if i < len(msgs)-1 {
			if err := nc.PublishMsg(m); err != nil {
				return 0, fmt.Errorf("publish batch: %w", err)
			}
		}
	}
	last := msgs[len(msgs)-1]
	last.Header.Set("Nats-Batch-Commit", "1")
	resp, err := nc.RequestMsgWithContext(ctx, last)
	if err != nil {
		return 0, fmt.Errorf("commit batch: %w", err)
	}
	var ack struct {
		Error *jetstream.APIError `json:"error"`
		Seq   uint64              `json:"seq"`
	}
	if err := json.Unmarshal(resp.Data, &ack); err != nil {
		return 0, fmt.Errorf("commit batch: decode the answer %q: %w", resp.Data, err)
	}
	if ack.Error != nil {
		return 0, ack.Error
	}
	return ack.Seq, nil
}

// retryable reports whether a failed batch may be decided again: a
// compare-and-set refusal, a full in-flight table, a lost message or a
// lost answer. A refusal for any other reason is final.
func retryable(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return true
	}
	switch apiErr.ErrorCode {
	case jetstream.JSErrCodeStreamWrongLastSequence, jetstream.JSErrCodeStreamWrongLastSequenceConstant,
		10176 /* incomplete batch */, 10210 /* too many batches in flight */ :
		return true
	}
	return false
}

func backoff(attempt int) time.Duration {
	d := time.Millisecond << min(attempt, 8)
	return min(d, 250*time.Millisecond)
}

// fencesFor returns the fence of each partition, from the cache unless
// fresh is set or the partition was never read.
func (s *Sink) fencesFor(ctx context.Context, parts []leasehold.Partition, fresh bool) (map[leasehold.Partition]fence, error) {
	out := make(map[leasehold.Partition]fence, len(parts))
	for _, p := range parts {
		s.mu.Lock()
		f, ok := s.fences[p]
		s.mu.Unlock()
		if !ok || fresh {
			m, err := s.last(ctx, fenceKey(p))
			if err != nil {
				return nil, err
			}
			if f, err = decodeFence(m); err != nil {
				return nil, err
			}
			s.mu.Lock()
			if f.rev >= s.fences[p].rev {
				s.fences[p] = f
			}
			s.mu.Unlock()
		}
		out[p] = f
	}
	return out, nil
}

// readDedupe marks the effects whose keys were applied before.
func (s *Sink) readDedupe(ctx context.Context, effects []sink.Effect, dup []bool) error {
	for i := range effects {
		if dup[i] {
			continue
		}
		m, err := s.last(ctx, dedupeKey(effects[i].Stamp.Key))
		if err != nil {
			return err
		}
		dup[i] = m.kind == entryValue
	}
	return nil
}

func partitionsOf(effects []sink.Effect) []leasehold.Partition {
	var parts []leasehold.Partition
	seen := map[leasehold.Partition]bool{}
	for i := range effects {
		if p := effects[i].Stamp.Partition; !seen[p] {
			seen[p] = true
			parts = append(parts, p)
		}
	}
	return parts
}

func (s *Sink) failed(ctx context.Context, e sink.Effect, err error) error {
	err = fmt.Errorf("kvsink: apply %s (partition %d, epoch %d): %w; retry with the same idempotency key, which applies it at most once", e.Stamp.Key, e.Stamp.Partition, e.Stamp.Epoch, err)
	s.rep.Report(ctx, sink.Decision{Outcome: sink.Failed, Stamp: e.Stamp, Subject: e.Subject, Err: err})
	return err
}

// Advance raises partition p's maximum to e if it is lower.
func (s *Sink) Advance(ctx context.Context, p leasehold.Partition, e leasehold.Epoch) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("kvsink: advance: %w", err)
	}
	if err := sink.ValidateAdvance(p, e); err != nil {
		return fmt.Errorf("kvsink: advance: %w", err)
	}
	st := leasehold.Stamp{Partition: p, Epoch: e}
	fresh := false
	for attempt := 0; ; attempt++ {
		fences, err := s.fencesFor(ctx, []leasehold.Partition{p}, fresh)
		if err != nil {
			return fmt.Errorf("kvsink: advance partition %d: %w", p, err)
		}
		f := fences[p]
		if e <= f.Epoch {
			return nil
		}
		if err := s.check.CheckAbove(ctx, st, f.Epoch); err != nil {
			if errors.Is(err, sink.ErrUnverifiedEpoch) {
				s.rep.Report(ctx, sink.Decision{Outcome: sink.Unverified, Stamp: st, Max: f.Epoch, Err: err})
			}
			return err
		}
		holder := sink.HolderFrom(ctx)
		body, _ := json.Marshal(fence{Epoch: e, Holder: holder})
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		ack, err := s.js.PublishMsg(rctx, &nats.Msg{Subject: s.prefix + fenceKey(p), Data: body}, jetstream.WithExpectLastSequencePerSubject(f.rev))
		cancel()
		if err == nil {
			s.mu.Lock()
			if ack.Sequence > s.fences[p].rev {
				s.fences[p] = fence{Epoch: e, Holder: holder, rev: ack.Sequence}
			}
			s.mu.Unlock()
			s.rep.Report(ctx, sink.Decision{Outcome: sink.Advanced, Stamp: st, Max: e})
			return nil
		}
		if !retryable(err) || ctx.Err() != nil {
			return fmt.Errorf("kvsink: advance partition %d to epoch %d: %w", p, e, err)
		}
		fresh = true
		select {
		case <-ctx.Done():
			return fmt.Errorf("kvsink: advance partition %d to epoch %d: %w (last attempt: %v)", p, e, ctx.Err(), err)
		case <-time.After(backoff(attempt)):
		}
	}
}

// MaxEpoch returns partition p's recorded maximum, read from the stream
// leader.
func (s *Sink) MaxEpoch(ctx context.Context, p leasehold.Partition) (leasehold.Epoch, error) {
	fences, err := s.fencesFor(ctx, []leasehold.Partition{p}, true)
	if err != nil {
		return 0, fmt.Errorf("kvsink: max epoch of partition %d: %w", p, err)
	}
	return fences[p].Epoch, nil
}
