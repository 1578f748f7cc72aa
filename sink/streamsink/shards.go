package streamsink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
)

// shardValue is the JSON value of a shard key: each fence's history, by
// scope and partition, oldest entry first.
type shardValue struct {
	Fences map[string]map[leasehold.Partition][]rise `json:"fences"`
}

func (r *Runner) shardKey(k int) string { return r.cfg.Consumer + ".fences." + strconv.Itoa(k) }

// encodeShard writes a shard's histories. HTML escaping is off so that
// the size bound (reserve) holds for scopes with '<', '>' or '&'.
func encodeShard(hist map[leasehold.FenceID][]rise) []byte {
	v := shardValue{Fences: make(map[string]map[leasehold.Partition][]rise)}
	for id, h := range hist {
		ps := v.Fences[id.Scope]
		if ps == nil {
			ps = make(map[leasehold.Partition][]rise)
			v.Fences[id.Scope] = ps
		}
		ps[id.Partition] = h
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
	return b.Bytes()
}

// decodeShard reads shard k of n, which anyone with access to the state
// bucket can write: it is checked, not trusted. It returns each fence as
// of position seq, and whether the value holds anything above seq (or
// fences that did not exist at seq) and must be written again before the
// position moves.
func decodeShard(data []byte, k, n int, seq uint64) (map[leasehold.FenceID]rise, bool, error) {
	var v shardValue
	if err := json.Unmarshal(data, &v); err != nil {
		return nil, false, fmt.Errorf("not leasehold's JSON: %w", err)
	}
	out := make(map[leasehold.FenceID]rise)
	ahead := false
	for scope, ps := range v.Fences {
		if err := leasehold.ValidateScope(scope); err != nil {
			return nil, false, err
		}
		for p, h := range ps {
			id := leasehold.FenceID{Scope: scope, Partition: p}
			if p >= leasehold.MaxPartitions {
				return nil, false, fmt.Errorf("fence %s: partition %d is not below %d", id, p, leasehold.MaxPartitions)
			}
			if shardOf(id, n) != k {
				return nil, false, fmt.Errorf("fence %s belongs in shard %d", id, shardOf(id, n))
			}
			if len(h) == 0 {
				return nil, false, fmt.Errorf("fence %s has no history", id)
			}
			var cur rise
			found := false
			for i, e := range h {
				if e.Epoch == 0 || e.Epoch > leasehold.MaxEpoch {
					return nil, false, fmt.Errorf("fence %s: epoch %d is outside 1..%d", id, e.Epoch, leasehold.MaxEpoch)
				}
				if e.Acquisition != "" {
					if err := leasehold.ValidateAcquisition(e.Acquisition); err != nil {
						return nil, false, fmt.Errorf("fence %s: %w", id, err)
					}
				}
				if i > 0 && (e.At <= h[i-1].At || e.Epoch < h[i-1].Epoch) {
					return nil, false, fmt.Errorf("fence %s: its history goes back at position %d", id, e.At)
				}
				if e.At > seq {
					ahead = true
					continue
				}
				e.Holder = holderOf(e.Holder)
				cur, found = e, true
			}
			if found {
				out[id] = cur
			}
		}
	}
	return out, ahead, nil
}

// loadShards reads every shard key of the consumer, through the stream
// leader, into t as of position seq. With skip (the position record was
// written before fence scopes), only their revisions are kept: whatever
// they hold is left by a conversion that did not finish.
func (r *Runner) loadShards(ctx context.Context, t *fenceTable, seq uint64, skip bool) error {
	prefix := r.kvSubject(r.cfg.Consumer + ".fences.")
	shards := make(map[int]map[leasehold.FenceID]rise)
	for next := uint64(1); ; {
		rctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
		m, err := r.state.Next(rctx, next, prefix+"*")
		cancel()
		if err != nil {
			return fmt.Errorf("streamsink: read the fences of %s/%s: %w", r.cfg.StateBucket, r.cfg.Consumer, err)
		}
		if m == nil {
			break
		}
		next = m.Seq + 1
		k, err := strconv.Atoi(strings.TrimPrefix(m.Subject, prefix))
		if err != nil || k < 0 || k >= t.n || strconv.Itoa(k) != strings.TrimPrefix(m.Subject, prefix) {
			if leader.IsMarker(m.Header) {
				// Deleted or purged, as the error below asks.
				continue
			}
			return fmt.Errorf("streamsink: key %s of %s is not one of the runner's %d fence shards: delete it", strings.TrimPrefix(m.Subject, "$KV."+r.cfg.StateBucket+"."), r.cfg.StateBucket, t.n)
		}
		// A bucket with a history keeps older values too; the last wins.
		t.rev[k] = m.Seq
		delete(shards, k)
		delete(t.stale, k)
		if leader.IsMarker(m.Header) || skip {
			continue
		}
		fences, ahead, err := decodeShard(m.Data, k, t.n, seq)
		if err != nil {
			return fmt.Errorf("streamsink: fence shard %s of %s: %w: fix or delete the consumer's keys, knowing that the runner then starts over", r.shardKey(k), r.cfg.StateBucket, err)
		}
		shards[k] = fences
		if ahead {
			t.stale[k] = true
		}
	}
	for _, fences := range shards {
		for id, f := range fences {
			t.add(id, f)
		}
	}
	return nil
}

// shardWriters bounds the shard writes one save has in flight.
const shardWriters = 16

// saveShards writes the shard values in todo, in parallel, and removes
// each from todo as it lands, recording its new revision in t. Until the
// position is saved, such a shard holds entries above it, so it counts as
// stale: should the save fail, the next one writes it again.
func (r *Runner) saveShards(ctx context.Context, t *fenceTable, todo map[int][]byte) error {
	var (
		mu      sync.Mutex
		wg      sync.WaitGroup
		errs    []error
		written = map[int]uint64{}
		sem     = make(chan struct{}, shardWriters)
	)
	// The writers touch only their own arguments and written; t changes
	// after they are all done, so no writer reads a map that another one
	// is writing.
	for k, body := range todo {
		wg.Add(1)
		sem <- struct{}{}
		go func(k int, body []byte, rev uint64) {
			defer func() { <-sem; wg.Done() }()
			nrev, err := r.put(ctx, r.shardKey(k), body, rev)
			if err != nil && isStateConflict(err) {
				nrev, err = r.mine(ctx, r.shardKey(k), body, err)
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("write fence shard %d: %w", k, err))
				return
			}
			written[k] = nrev
		}(k, body, t.rev[k])
	}
	wg.Wait()
	r.mu.Lock()
	for k, rev := range written {
		t.rev[k] = rev
		t.stale[k] = true
	}
	r.mu.Unlock()
	for k := range written {
		delete(todo, k)
	}
	return errors.Join(errs...)
}
