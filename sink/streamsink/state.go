package streamsink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/internal/leader"
)

// ErrStateConflict is returned by Run when the runner's saved progress was
// changed by someone else: another runner with the same consumer name.
// Run one runner per consumer.
var ErrStateConflict = errors.New("streamsink: another runner saved progress under this consumer name")

// ErrLegacyState is matched by the error New returns for progress saved
// before fence scopes when Config.LegacyScope is not set.
var ErrLegacyState = errors.New("streamsink: the saved progress was written before fence scopes")

// The saved state, in the state bucket:
//
//	<consumer>                 the position record (position)
//	<consumer>.fences.<shard>  the fences of one shard (see encodeShard)
//
// Every message up to the position has been decided and its outcome
// delivered. A batch writes the shards its fences rose in first, then the
// position; most batches raise no fence and write the position alone.

// positionFormat is the format of the position record with sharded fences.
// Progress saved before fence scopes has no format field and holds every
// fence in the record itself.
const positionFormat = 2

// position is the position record.
type position struct {
	Format int    `json:"format"`
	Seq    uint64 `json:"seq"`
	Shards int    `json:"shards"`
	// Fences says where the fences are. It is a string where a runner built
	// before fence scopes reads an object, so that such a runner refuses
	// this state instead of starting over with no fences.
	Fences string `json:"fences"`
	// Skipped lists the latest gaps an operator resumed past: log
	// positions given up for lost.
	Skipped []skip `json:"skipped,omitempty"`
	// Applied lists the jobs applied since the applied shards were last
	// written (see applied.go).
	Applied []appliedEntry `json:"applied,omitempty"`
}

// legacyState is the progress a runner built before fence scopes saved.
type legacyState struct {
	Seq    uint64 `json:"seq"`
	Fences map[leasehold.Partition]struct {
		Epoch  leasehold.Epoch `json:"epoch"`
		Holder string          `json:"holder,omitempty"`
	} `json:"fences"`
}

func (r *Runner) positionKey() string { return r.cfg.Consumer }

func (r *Runner) encodePosition(seq uint64) []byte {
	b, _ := json.Marshal(position{Format: positionFormat, Seq: seq, Shards: r.fences.n,
		Fences:  "in keys " + r.cfg.Consumer + ".fences.<shard>; read by leasehold stream sinks with fence scopes",
		Skipped: r.skips, Applied: r.groups.deltaEntries()})
	return b
}

// loaded is the saved state as New reads it.
type loaded struct {
	seq    uint64
	rev    uint64 // the position record's revision; 0: none saved
	fences *fenceTable
	skips  []skip
	legacy bool // converted from progress saved before fence scopes: to be saved at once
	delta  []appliedEntry
}

// loadState reads the saved position and fences through the state bucket's
// stream leader. The fences decide which effects are stale, and a direct
// get may be answered by a replica that has not seen the last save: a
// runner that started from it could apply an effect the saved fences
// refuse before its first save failed.
func (r *Runner) loadState(ctx context.Context) (loaded, error) {
	where := r.cfg.StateBucket + "/" + r.positionKey()
	m, err := r.state.Last(ctx, r.kvSubject(r.positionKey()))
	if err != nil {
		return loaded{}, fmt.Errorf("streamsink: read progress %s: %w", where, err)
	}
	out := loaded{fences: newFenceTable(numShards)}
	var legacy *legacyState
	if m != nil && !leader.IsMarker(m.Header) {
		var probe struct {
			Format  int             `json:"format"`
			Seq     uint64          `json:"seq"`
			Shards  int             `json:"shards"`
			Fences  json.RawMessage `json:"fences"`
			Skipped []skip          `json:"skipped"`
			Applied []appliedEntry  `json:"applied"`
		}
		if err := json.Unmarshal(m.Data, &probe); err != nil {
			return loaded{}, fmt.Errorf("streamsink: progress %s is not leasehold's JSON (%v): fix or delete the key and its %s.fences.* keys, knowing that the runner then starts over", where, err, r.positionKey())
		}
		switch probe.Format {
		case 0:
			legacy = &legacyState{}
			if err := json.Unmarshal(m.Data, legacy); err != nil {
				return loaded{}, fmt.Errorf("streamsink: progress %s, saved before fence scopes, cannot be read (%v): fix or delete the key, knowing that the runner then starts over", where, err)
			}
		case positionFormat:
			if probe.Shards < 1 || probe.Shards > leasehold.MaxPartitions {
				return loaded{}, fmt.Errorf("streamsink: progress %s names %d fence shards: not leasehold's; fix or delete the key and its %s.fences.* keys, knowing that the runner then starts over", where, probe.Shards, r.positionKey())
			}
			out.fences = newFenceTable(probe.Shards)
			if len(probe.Skipped) > maxSkips {
				probe.Skipped = probe.Skipped[len(probe.Skipped)-maxSkips:]
			}
			out.skips = probe.Skipped
			for _, e := range probe.Applied {
				if err := e.validate(); err != nil {
					return loaded{}, fmt.Errorf("streamsink: progress %s lists an applied job that is not leasehold's (%v): fix or delete the key, knowing that jobs are then applied again", where, err)
				}
			}
			out.delta = probe.Applied
		default:
			return loaded{}, fmt.Errorf("streamsink: progress %s has format %d, which this runner does not know: it was saved by a later version; run that version", where, probe.Format)
		}
		out.seq, out.rev = probe.Seq, m.Seq
	} else if m != nil {
		out.rev = m.Seq
	}
	// out.fences becomes the runner's only once everything is loaded,
	// under mu (New, reload): a load that fails half-way must leave the
	// runner's fences as they were, not a table missing some of them for
	// the next save to write out.
	if err := r.loadShards(ctx, out.fences, out.seq, legacy != nil); err != nil {
		return loaded{}, err
	}
	if legacy != nil {
		if err := r.adoptLegacy(out.fences, legacy); err != nil {
			return loaded{}, err
		}
		out.legacy = true
	}
	return out, nil
}

// adoptLegacy takes the fences of progress saved before fence scopes as
// Config.LegacyScope's, as of its position. The first save writes them in
// shards and the position record over the old value.
func (r *Runner) adoptLegacy(t *fenceTable, s *legacyState) error {
	if len(s.Fences) > 0 && r.cfg.LegacyScope == "" {
		return fmt.Errorf("%w (%s/%s holds %d fences with no scope): set Config.LegacyScope to the scope that wrote it, normally the job stream's prefix, and the runner converts it in place; or use a fresh state bucket or consumer name, knowing that the runner then decides the whole log again",
			ErrLegacyState, r.cfg.StateBucket, r.positionKey(), len(s.Fences))
	}
	for p, f := range s.Fences {
		if p >= leasehold.MaxPartitions || f.Epoch > leasehold.MaxEpoch {
			return fmt.Errorf("streamsink: progress %s/%s, saved before fence scopes, holds partition %d at epoch %d: not leasehold's; fix or delete the key", r.cfg.StateBucket, r.positionKey(), p, f.Epoch)
		}
		if f.Epoch == 0 {
			continue
		}
		t.add(leasehold.FenceID{Scope: r.cfg.LegacyScope, Partition: p}, rise{At: s.Seq, Epoch: f.Epoch, Holder: holderOf(f.Holder)})
	}
	// Shards left by a conversion that did not finish are written over.
	for k := range t.members {
		if len(t.members[k]) > 0 || t.rev[k] > 0 {
			t.stale[k] = true
		}
	}
	return nil
}

// savePosition writes position seq over revision rev and returns the new
// revision. A conflict whose saved record is ours (an earlier attempt whose
// answer was lost) is success.
func (r *Runner) savePosition(ctx context.Context, seq, rev uint64) (uint64, error) {
	body := r.encodePosition(seq)
	nrev, err := r.put(ctx, r.positionKey(), body, rev)
	if err == nil || !isStateConflict(err) {
		return nrev, err
	}
	return r.mine(ctx, r.positionKey(), body, err)
}

// put writes key over revision rev (0: the key must hold nothing, or a
// delete or purge marker). It publishes to the key's subject and waits
// for the acknowledgement with jspub, so a save whose answer a server
// restart lost is retried as soon as the connection drops, not after
// RequestTimeout (kv.Update's request waited it out, and the runner
// with it).
func (r *Runner) put(ctx context.Context, key string, body []byte, rev uint64) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
	defer cancel()
	seq, err := r.publishState(ctx, key, body, rev)
	if rev != 0 || !isStateConflict(err) {
		return seq, err
	}
	// Create over a marker, as kv.Create does: the key was deleted or
	// purged, and the marker's revision is the one to write over.
	m, lerr := r.state.Last(ctx, r.kvSubject(key))
	if lerr != nil || m == nil || !leader.IsMarker(m.Header) {
		return 0, err
	}
	return r.publishState(ctx, key, body, m.Seq)
}

func (r *Runner) publishState(ctx context.Context, key string, body []byte, rev uint64) (uint64, error) {
	msg := &nats.Msg{Subject: r.kvSubject(key), Data: body}
	ack, err := jspub.Publish(ctx, r.js, msg, jetstream.WithExpectLastSequencePerSubject(rev))
	if err != nil {
		return 0, err
	}
	return ack.Sequence, nil
}

// mine resolves a conflicting write of body to key: when the key holds
// body, an earlier attempt whose answer was lost landed, and its revision
// is returned; otherwise another runner wrote it.
func (r *Runner) mine(ctx context.Context, key string, body []byte, conflict error) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
	defer cancel()
	m, err := r.state.Last(ctx, r.kvSubject(key))
	if err != nil {
		return 0, err
	}
	if m != nil && !leader.IsMarker(m.Header) && bytes.Equal(m.Data, body) {
		return m.Seq, nil
	}
	if isInFlight(conflict) {
		// A write to the key is still being stored (an earlier attempt
		// whose answer was lost, most likely), and the key does not show
		// it yet: the save is tried again after a backoff, when it does.
		return 0, fmt.Errorf("streamsink: key %s of %s has a write still being stored: %w", key, r.cfg.StateBucket, conflict)
	}
	return 0, fmt.Errorf("%w: consumer %s: key %s of %s was written by someone else (%v)", ErrStateConflict, r.cfg.Consumer, key, r.cfg.StateBucket, conflict)
}

func (r *Runner) kvSubject(key string) string { return "$KV." + r.cfg.StateBucket + "." + key }

// isInFlight reports whether err is a replicated stream's refusal of a
// compare-and-set on a key with an earlier write still being stored
// (10164, "wrong last sequence" with no number); until it is stored the
// key reads as before it.
func isInFlight(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
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
