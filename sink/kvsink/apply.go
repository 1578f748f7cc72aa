package kvsink

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// maxEffects bounds one Apply. An effect takes at most three messages of
// the atomic batch (its fence, when no other effect of the batch shares
// it, its dedupe key and its value), and the server caps a batch at 1000
// messages by default.
const maxEffects = 333

// maxAttempts bounds how often one Apply or Advance decides again after
// another writer moved a fence or applied a key first, or an answer was
// lost. With the backoff between attempts (up to a quarter of a second)
// that is about ten seconds of waiting, besides the requests.
const maxAttempts = 64

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
		if err := CheckKey(effects[i].Subject); err != nil {
			s.rep.Report(ctx, sink.Decision{Outcome: sink.Failed, Stamp: effects[i].Stamp, Subject: effects[i].Subject, Err: err})
			return err
		}
	}
	ids := fencesOf(effects)
	fences, err := s.fencesFor(ctx, ids, false)
	if err != nil {
		return s.failed(ctx, effects[0], err)
	}
	for i := range effects {
		// Every stamp that would raise its fence as read is verified; a
		// fence read again later is only higher, and what raises it raised
		// this one too.
		if err := s.check.CheckRaise(ctx, effects[i].Stamp, fences[effects[i].Stamp.Fence()].state); err != nil {
			o := sink.Failed
			if errors.Is(err, sink.ErrUnverifiedEpoch) {
				o = sink.Unverified
			}
			s.rep.Report(ctx, sink.Decision{Outcome: o, Stamp: effects[i].Stamp, Subject: effects[i].Subject, Err: err})
			return err
		}
	}
	keys := make([]keyState, len(effects))
	var last error
	for attempt := 0; attempt < maxAttempts; attempt++ {
		if attempt > 0 {
			// Another writer moved a fence or applied a key first, or the
			// answer was lost: read both again and decide again.
			if err := s.wait(ctx, attempt, last); err != nil {
				return s.failed(ctx, effects[0], err)
			}
			if fences, err = s.fencesFor(ctx, ids, true); err != nil {
				return s.failed(ctx, effects[0], err)
			}
			if err := s.readDedupe(ctx, effects, keys); err != nil {
				return s.failed(ctx, effects[0], err)
			}
		}
		if err := s.migrate(ctx, fences); err != nil {
			if last = err; retryable(err) {
				continue
			}
			return s.failed(ctx, effects[0], err)
		}
		// Judge against the fences as the batch would leave them. A cached
		// fence is never above the server's, so a refusal against it is
		// final.
		next := make(map[leasehold.FenceID]fence, len(ids))
		for i := range effects {
			st := effects[i].Stamp
			id := st.Fence()
			f, ok := next[id]
			if !ok {
				f = fences[id]
			}
			v, raise := leasehold.Judge(f.state, st)
			if v != leasehold.Admit {
				return s.refused(ctx, effects, i, f.state, v)
			}
			if raise || (st.Worker != "" && st.Worker != f.state.Holder) {
				f.state = leasehold.FenceState{Epoch: st.Epoch, Acquisition: st.Acquisition, Holder: st.Worker}
			}
			next[id] = f
		}
		msgs := s.batch(effects, keys, ids, next)
		seq, err := s.publishBatch(ctx, msgs)
		if err == nil {
			first := seq - uint64(len(msgs)-1)
			for j, id := range ids {
				f := next[id]
				f.rev, f.legacyRev = first+uint64(j), 0
				s.remember(id, f)
			}
			for i := range effects {
				o := sink.Accepted
				if keys[i].dup {
					o = sink.Duplicate
				}
				s.rep.Report(ctx, sink.Decision{Outcome: o, Stamp: effects[i].Stamp, Subject: effects[i].Subject, Max: next[effects[i].Stamp.Fence()].state.Epoch})
			}
			return nil
		}
		if last = err; !retryable(err) {
			return s.failed(ctx, effects[0], err)
		}
	}
	return s.failed(ctx, effects[0], giveUp(last))
}

// keyState is what a batch knows of one effect's dedupe records: whether
// it was applied before, and the revisions its dedupe keys must still be
// at (0 when empty; a marker's when a key was deleted).
type keyState struct {
	dup       bool
	rev       uint64
	legacyRev uint64
}

// refused reports and returns the refusal of effects[i] by fence f.
func (s *Sink) refused(ctx context.Context, effects []sink.Effect, i int, f leasehold.FenceState, v leasehold.Verdict) error {
	st := effects[i].Stamp
	err := leasehold.Refusal(f, st, v)
	s.rep.Report(ctx, sink.Decision{Outcome: sink.Refused(v), Stamp: st, Subject: effects[i].Subject, Max: f.Epoch, MaxAcquisition: f.Acquisition, Holder: f.Holder, Err: err})
	if len(effects) > 1 {
		return fmt.Errorf("kvsink: effect %d of %d: %w (no effect of the batch was applied)", i+1, len(effects), err)
	}
	return err
}

// batch builds the messages of one atomic batch: each fence, written only
// over the revision read, then each effect's dedupe key, written only if
// new, and its value. Effects known to be duplicates contribute nothing
// but their fence. An effect of the legacy scope also needs the key's
// dedupe record from before fence scopes to be absent: its value carries
// that expectation, so the check is part of the batch and costs no message.
func (s *Sink) batch(effects []sink.Effect, keys []keyState, ids []leasehold.FenceID, next map[leasehold.FenceID]fence) []*nats.Msg {
	msgs := make([]*nats.Msg, 0, len(ids)+2*len(effects))
	for _, id := range ids {
		f := next[id]
		m := nats.NewMsg(s.prefix + fenceKey(id))
		m.Data = encodeFence(f.state)
		m.Header[jetstream.ExpectedLastSubjSeqHeader] = []string{strconv.FormatUint(f.rev, 10)}
		msgs = append(msgs, m)
	}
	var ttl string
	if s.cfg.DedupeTTL > 0 {
		ttl = strconv.Itoa(int(s.cfg.DedupeTTL/time.Second)) + "s"
	}
	seen := make(map[dedupeID]bool, len(effects))
	for i := range effects {
		e := &effects[i]
		k := dedupeID{e.Stamp.Scope, e.Stamp.Key}
		if seen[k] {
			keys[i].dup = true
		}
		seen[k] = true
		if keys[i].dup {
			continue
		}
		dv := dedupeValue(e.Stamp.Scope, e.Stamp.Key)
		d := nats.NewMsg(s.prefix + dedupeName(dv))
		d.Data = dv
		d.Header[jetstream.ExpectedLastSubjSeqHeader] = []string{strconv.FormatUint(keys[i].rev, 10)}
		if ttl != "" {
			d.Header[jetstream.MsgTTLHeader] = []string{ttl}
		}
		v := nats.NewMsg(s.prefix + e.Subject)
		v.Data = e.Data
		copyHeader(v.Header, e.Header)
		e.Stamp.SetHeader(v.Header)
		if e.Stamp.Scope == s.cfg.LegacyScope {
			v.Header[jetstream.ExpectedLastSubjSeqHeader] = []string{strconv.FormatUint(keys[i].legacyRev, 10)}
			v.Header[expectedLastSubjSeqSubjHeader] = []string{s.prefix + legacyDedupeKey(e.Stamp.Key)}
		}
		msgs = append(msgs, d, v)
	}
	return msgs
}

// expectedLastSubjSeqSubjHeader points a message's expected last
// sequence per subject at another subject (nats-server 2.11 or later).
const expectedLastSubjSeqSubjHeader = "Nats-Expected-Last-Subject-Sequence-Subject"

// dedupeID is an idempotency key within its scope.
type dedupeID struct{ scope, key string }

// copyHeader copies into dst the headers of an effect that may travel with
// its value: leasehold's own (but the stamp's, which the stamp writes) and
// W3C trace context. Nothing else: a header in the server's Nats-
// namespace changes how the server treats the write (an effect carrying
// Nats-Expected-Stream would fail every batch it is in, for ever; a
// Nats-Msg-Id would have the server drop a later effect as a duplicate).
func copyHeader(dst nats.Header, src map[string][]string) {
	for k, vs := range src {
		if keepHeader(k) {
			dst[k] = append([]string(nil), vs...)
		}
	}
}

func keepHeader(name string) bool {
	const lh = "Leasehold-"
	if len(name) > len(lh) && strings.EqualFold(name[:len(lh)], lh) {
		for i := len(lh); i < len(name); i++ {
			if c := name[i]; c <= ' ' || c >= 0x7f || c == ':' {
				return false
			}
		}
		return !isStampHeader(name)
	}
	return strings.EqualFold(name, "traceparent") || strings.EqualFold(name, "tracestate") || strings.EqualFold(name, "baggage")
}

func isStampHeader(name string) bool {
	for _, h := range [...]string{leasehold.HeaderScope, leasehold.HeaderPartition, leasehold.HeaderEpoch, leasehold.HeaderAcquisition, leasehold.HeaderKey, leasehold.HeaderWorker} {
		if strings.EqualFold(name, h) {
			return true
		}
	}
	return false
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
		m.Header["Nats-Batch-Id"] = []string{batchID}
		m.Header["Nats-Batch-Sequence"] = []string{strconv.Itoa(i + 1)}
		if i < len(msgs)-1 {
			if err := nc.PublishMsg(m); err != nil {
				return 0, fmt.Errorf("publish batch: %w", err)
			}
		}
	}
	last := msgs[len(msgs)-1]
	last.Header["Nats-Batch-Commit"] = []string{"1"}
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
	if ack.Seq < uint64(len(msgs)) {
		return 0, fmt.Errorf("commit batch: the answer names sequence %d for a batch of %d messages", ack.Seq, len(msgs))
	}
	return ack.Seq, nil
}

// retryable reports whether a failed batch may be decided again: a
// compare-and-set refusal, a full in-flight table, a lost message or a
// lost answer. A refusal for any other reason is final, and so is a
// message the client will not send however often it is tried.
func retryable(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return !errors.Is(err, nats.ErrMaxPayload) && !errors.Is(err, nats.ErrBadHeaderMsg) &&
			!errors.Is(err, nats.ErrBadSubject) && !errors.Is(err, nats.ErrConnectionClosed)
	}
	switch apiErr.ErrorCode {
	case jetstream.JSErrCodeStreamWrongLastSequence, jetstream.JSErrCodeStreamWrongLastSequenceConstant,
		10176 /* incomplete batch */, 10210 /* too many batches in flight */ :
		return true
	}
	return false
}

// wait sleeps before attempt, with jitter so that writers that collided
// do not collide again.
func (s *Sink) wait(ctx context.Context, attempt int, last error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (last attempt: %v)", ctx.Err(), last)
	}
	if attempt == 1 {
		return nil
	}
	d := min(time.Millisecond<<min(attempt-1, 8), 250*time.Millisecond)
	d = d/2 + mrand.N(d/2+1)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return fmt.Errorf("%w (last attempt: %v)", ctx.Err(), last)
	case <-t.C:
		return nil
	}
}

// giveUp is the error after maxAttempts decisions in a row were undone by
// other writers or lost answers.
func giveUp(last error) error {
	return fmt.Errorf("gave up after %d attempts, each undone by another writer or a lost answer (last: %w)", maxAttempts, last)
}

// readDedupe marks the effects whose (scope, key) was applied before, and
// records the revisions their dedupe keys are at.
func (s *Sink) readDedupe(ctx context.Context, effects []sink.Effect, keys []keyState) error {
	for i := range effects {
		if keys[i].dup {
			continue
		}
		st := effects[i].Stamp
		m, err := s.last(ctx, dedupeKey(st.Scope, st.Key))
		if err != nil {
			return err
		}
		keys[i].rev, keys[i].dup = m.rev, m.kind == entryValue
		if keys[i].dup || st.Scope != s.cfg.LegacyScope {
			continue
		}
		if m, err = s.last(ctx, legacyDedupeKey(st.Key)); err != nil {
			return err
		}
		keys[i].legacyRev, keys[i].dup = m.rev, m.kind == entryValue
	}
	return nil
}

func fencesOf(effects []sink.Effect) []leasehold.FenceID {
	ids := make([]leasehold.FenceID, 0, 1)
	for i := range effects {
		id := effects[i].Stamp.Fence()
		if !containsFence(ids, id) {
			ids = append(ids, id)
		}
	}
	return ids
}

func containsFence(ids []leasehold.FenceID, id leasehold.FenceID) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

func (s *Sink) failed(ctx context.Context, e sink.Effect, err error) error {
	err = fmt.Errorf("kvsink: apply %s (%s, epoch %d): %w; retry with the same idempotency key, which applies it at most once", e.Stamp.Key, e.Stamp.Fence(), e.Stamp.Epoch, err)
	s.rep.Report(ctx, sink.Decision{Outcome: sink.Failed, Stamp: e.Stamp, Subject: e.Subject, Err: err})
	return err
}
