package kvsink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// fenceRecord is the JSON value of a fence key. Records written before
// fence scopes have no acquisition.
type fenceRecord struct {
	Epoch       leasehold.Epoch `json:"epoch"`
	Acquisition string          `json:"acquisition,omitempty"`
	Holder      string          `json:"holder,omitempty"`
}

// fence is what the sink knows of one fence: its state and the revision of
// its key, which the next write of the key must still find (0: the key
// holds nothing). legacyRev is set when the key held nothing and the state
// was read from the fence record of a bucket written before fence scopes,
// at that revision: the first write moves the record (see migrate).
type fence struct {
	state     leasehold.FenceState
	rev       uint64
	legacyRev uint64
}

// newer reports whether f was read later than g.
func (f fence) newer(g fence) bool {
	return f.rev > g.rev || f.rev == g.rev && f.legacyRev >= g.legacyRev
}

// maxCachedFences bounds the fences the sink remembers. A fence it
// forgot costs one read of its key; forged stamps can name any number of
// scopes.
const maxCachedFences = 1 << 16

// movedPrefix starts the value a migrated legacy fence key holds. It is
// not JSON, so a sink built before fence scopes fails on the partition
// (and names the key and this text in its error) instead of fencing
// against a record that no longer moves.
const movedPrefix = "moved to "

func movedValue(id leasehold.FenceID) []byte {
	return []byte(movedPrefix + fenceKey(id) + ": this bucket is written by leasehold sinks with fence scopes; upgrade every sink that writes it")
}

// errFenceLost is matched by the error for a fence whose record was
// deleted after a legacy record moved into it.
var errFenceLost = errors.New("kvsink: fence record is missing")

func encodeFence(st leasehold.FenceState) []byte {
	b, _ := json.Marshal(fenceRecord{Epoch: st.Epoch, Acquisition: st.Acquisition, Holder: st.Holder})
	return b
}

// decodeFence reads a fence record. The bucket can be written by anyone
// with access to it, so the record is checked, not trusted.
func decodeFence(m entry) (leasehold.FenceState, error) {
	var r fenceRecord
	if err := json.Unmarshal(m.data, &r); err != nil {
		return leasehold.FenceState{}, fmt.Errorf("kvsink: fence key %s holds %q, which is not leasehold's JSON: %w", m.subject, m.data, err)
	}
	if r.Epoch > leasehold.MaxEpoch {
		return leasehold.FenceState{}, fmt.Errorf("kvsink: fence key %s holds epoch %d, above the largest %d", m.subject, r.Epoch, leasehold.MaxEpoch)
	}
	if r.Acquisition != "" {
		if err := leasehold.ValidateAcquisition(r.Acquisition); err != nil {
			return leasehold.FenceState{}, fmt.Errorf("kvsink: fence key %s: %w", m.subject, err)
		}
	}
	return leasehold.FenceState{Epoch: r.Epoch, Acquisition: r.Acquisition, Holder: r.Holder}, nil
}

// readFence reads fence id from the stream leader. A fence of the legacy
// scope whose key holds nothing is read from its legacy key.
func (s *Sink) readFence(ctx context.Context, id leasehold.FenceID) (fence, error) {
	m, err := s.last(ctx, fenceKey(id))
	if err != nil {
		return fence{}, err
	}
	f := fence{rev: m.rev}
	if m.kind == entryValue {
		f.state, err = decodeFence(m)
		return f, err
	}
	if s.cfg.LegacyScope == "" || id.Scope != s.cfg.LegacyScope {
		return f, nil
	}
	lm, err := s.last(ctx, legacyFenceKey(id.Partition))
	if err != nil || lm.kind != entryValue {
		return f, err
	}
	if bytes.HasPrefix(lm.data, []byte(movedPrefix)) {
		return fence{}, fmt.Errorf("%w: %s is gone, though the record of the same partition before fence scopes (%s) moved there: something deleted it, and writes to %s stay refused until it is written again with the highest epoch issued for it",
			errFenceLost, fenceKey(id), legacyFenceKey(id.Partition), id)
	}
	if f.state, err = decodeFence(lm); err != nil {
		return fence{}, err
	}
	f.legacyRev = lm.rev
	return f, nil
}

// fencesFor returns the fence of each id, from the cache unless fresh is
// set or the fence was never read.
func (s *Sink) fencesFor(ctx context.Context, ids []leasehold.FenceID, fresh bool) (map[leasehold.FenceID]fence, error) {
	out := make(map[leasehold.FenceID]fence, len(ids))
	for _, id := range ids {
		s.mu.Lock()
		f, ok := s.fences[id]
		s.mu.Unlock()
		if !ok || fresh {
			var err error
			if f, err = s.readFence(ctx, id); err != nil {
				return nil, err
			}
			s.remember(id, f)
		}
		out[id] = f
	}
	return out, nil
}

// remember caches f as fence id's, unless a later read is cached.
func (s *Sink) remember(id leasehold.FenceID, f fence) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old, ok := s.fences[id]
	if ok && !f.newer(old) {
		return
	}
	if !ok && len(s.fences) >= maxCachedFences {
		for k := range s.fences {
			delete(s.fences, k)
			break
		}
	}
	s.fences[id] = f
}

// migrate moves the legacy fence records among fs into their scoped keys,
// in one atomic batch: each scoped key gets the legacy record's state,
// written only if it still holds nothing, and each legacy key the moved
// marker, written only if it still holds the record read. A sink built
// before fence scopes that raised a legacy fence meanwhile makes the batch
// fail, and the caller reads again. fs is updated in place.
func (s *Sink) migrate(ctx context.Context, fs map[leasehold.FenceID]fence) error {
	var ids []leasehold.FenceID
	var msgs []*nats.Msg
	for id, f := range fs {
		if f.legacyRev == 0 {
			continue
		}
		ids = append(ids, id)
		m := nats.NewMsg(s.prefix + fenceKey(id))
		m.Data = encodeFence(f.state)
		m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(f.rev, 10))
		l := nats.NewMsg(s.prefix + legacyFenceKey(id.Partition))
		l.Data = movedValue(id)
		l.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(f.legacyRev, 10))
		msgs = append(msgs, m, l)
	}
	if len(msgs) == 0 {
		return nil
	}
	seq, err := s.publishBatch(ctx, msgs)
	if err != nil {
		return fmt.Errorf("move the fence records written before fence scopes: %w", err)
	}
	first := seq - uint64(len(msgs)-1)
	for i, id := range ids {
		f := fence{state: fs[id].state, rev: first + 2*uint64(i)}
		fs[id] = f
		s.remember(id, f)
	}
	return nil
}

// Advance raises the fence of l's scope and partition to l's epoch and
// acquisition, recording l.Holder. It returns a *leasehold.StaleEpochError
// (wrapped) when the fence is above l's epoch, or at it for another
// acquisition. It reads the fence through the stream leader, so that a
// lease the fence has passed is told so.
func (s *Sink) Advance(ctx context.Context, l leasehold.Lease) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("kvsink: advance: %w", err)
	}
	if err := sink.ValidateAdvance(l); err != nil {
		return fmt.Errorf("kvsink: advance: %w", err)
	}
	st := sink.AdvanceStamp(l)
	report := st
	report.Key = ""
	id := l.Fence()
	var last error
	for attempt := 0; attempt < maxAttempts; attempt++ {
		if attempt > 0 {
			if err := s.wait(ctx, attempt, last); err != nil {
				return fmt.Errorf("kvsink: advance %s to epoch %d: %w", id, l.Epoch, err)
			}
		}
		fs, err := s.fencesFor(ctx, []leasehold.FenceID{id}, true)
		if err != nil {
			return fmt.Errorf("kvsink: advance %s: %w", id, err)
		}
		if err := s.migrate(ctx, fs); err != nil {
			if last = err; retryable(err) {
				continue
			}
			return fmt.Errorf("kvsink: advance %s: %w", id, err)
		}
		f := fs[id]
		v, raise := leasehold.Judge(f.state, st)
		if v != leasehold.Admit {
			err := leasehold.Refusal(f.state, st, v)
			s.rep.Report(ctx, sink.Decision{Outcome: sink.Refused(v), Stamp: report, Max: f.state.Epoch, MaxAcquisition: f.state.Acquisition, Holder: f.state.Holder, Err: err})
			return fmt.Errorf("kvsink: advance: %w", err)
		}
		if !raise {
			return nil
		}
		if err := s.check.Check(ctx, st); err != nil {
			if errors.Is(err, sink.ErrUnverifiedEpoch) {
				s.rep.Report(ctx, sink.Decision{Outcome: sink.Unverified, Stamp: report, Max: f.state.Epoch, Err: err})
			}
			return err
		}
		next := leasehold.FenceState{Epoch: l.Epoch, Acquisition: l.Acquisition, Holder: l.Holder}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		ack, err := s.js.PublishMsg(rctx, &nats.Msg{Subject: s.prefix + fenceKey(id), Data: encodeFence(next)}, jetstream.WithExpectLastSequencePerSubject(f.rev))
		cancel()
		if err == nil {
			s.remember(id, fence{state: next, rev: ack.Sequence})
			s.rep.Report(ctx, sink.Decision{Outcome: sink.Advanced, Stamp: report, Max: l.Epoch})
			return nil
		}
		if last = err; !retryable(err) {
			return fmt.Errorf("kvsink: advance %s to epoch %d: %w", id, l.Epoch, err)
		}
	}
	return fmt.Errorf("kvsink: advance %s to epoch %d: %w", id, l.Epoch, giveUp(last))
}

// Fence returns what the sink records for id, read from the stream
// leader; the zero FenceState if nothing. A fence of the legacy scope not
// written since fence scopes is read from its legacy record.
func (s *Sink) Fence(ctx context.Context, id leasehold.FenceID) (leasehold.FenceState, error) {
	if err := leasehold.ValidateScope(id.Scope); err != nil {
		return leasehold.FenceState{}, fmt.Errorf("kvsink: fence %s: %w", id, err)
	}
	if id.Partition >= leasehold.MaxPartitions {
		return leasehold.FenceState{}, fmt.Errorf("kvsink: fence %s: partition %d is not below %d", id, id.Partition, leasehold.MaxPartitions)
	}
	fs, err := s.fencesFor(ctx, []leasehold.FenceID{id}, true)
	if err != nil {
		return leasehold.FenceState{}, fmt.Errorf("kvsink: fence %s: %w", id, err)
	}
	return fs[id].state, nil
}

// Dropped returns how many effects of fence id were refused.
func (s *Sink) Dropped(id leasehold.FenceID) uint64 { return s.rep.Dropped(id) }
