package streamsink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
)

// ErrStateConflict is returned by Run when the runner's saved progress was
// changed by someone else: another runner with the same consumer name.
// Run one runner per consumer.
var ErrStateConflict = errors.New("streamsink: another runner saved progress under this consumer name")

// state is the runner's progress: every log message up to Seq has been
// decided and its outcome delivered, and Fences holds each partition's
// maximum as of Seq.
type state struct {
	Seq    uint64                            `json:"seq"`
	Fences map[leasehold.Partition]fenceInfo `json:"fences"`
}

type fenceInfo struct {
	Epoch  leasehold.Epoch `json:"epoch"`
	Holder string          `json:"holder,omitempty"`
}

func (s state) clone() state {
	c := state{Seq: s.Seq, Fences: make(map[leasehold.Partition]fenceInfo, len(s.Fences))}
	for p, f := range s.Fences {
		c.Fences[p] = f
	}
	return c
}

// loadState reads the saved progress and its revision (0: none saved)
// through the state bucket's stream leader. Its fences decide which
// effects are stale, and a direct get may be answered by a replica that
// has not seen the last save: a runner that started from it could apply
// an effect the saved fences refuse before its first save failed.
func (r *Runner) loadState(ctx context.Context) (state, uint64, error) {
	m, err := r.state.Last(ctx, "$KV."+r.cfg.StateBucket+"."+r.cfg.Consumer)
	if err != nil {
		return state{}, 0, fmt.Errorf("streamsink: read progress %s/%s: %w", r.cfg.StateBucket, r.cfg.Consumer, err)
	}
	if m == nil || leader.IsMarker(m.Header) {
		return state{Fences: map[leasehold.Partition]fenceInfo{}}, 0, nil
	}
	var s state
	if err := json.Unmarshal(m.Data, &s); err != nil {
		return state{}, 0, fmt.Errorf("streamsink: progress %s/%s is not leasehold's JSON (%v): fix or delete the key, knowing that the runner then starts over", r.cfg.StateBucket, r.cfg.Consumer, err)
	}
	if s.Fences == nil {
		s.Fences = map[leasehold.Partition]fenceInfo{}
	}
	return s, m.Seq, nil
}

// saveState writes s over revision rev and returns the new revision.
func (r *Runner) saveState(ctx context.Context, s state, rev uint64) (uint64, error) {
	body, err := json.Marshal(s)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
	defer cancel()
	if rev == 0 {
		return r.stateKV.Create(ctx, r.cfg.Consumer, body)
	}
	return r.stateKV.Update(ctx, r.cfg.Consumer, body, rev)
}

// isStateConflict reports whether a save failed because the saved
// revision moved.
func isStateConflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}
