package streamsink

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
)

// What the runner applied of jobs, per fence and subject, is saved in
// appliedShards keys "<consumer>.applied.<shard>", a fence's shard fixed
// by shardOf, and the jobs applied since those were last written ride in
// the position record (its "applied" list), which every batch writes
// anyway: a batch of jobs costs no write more than a batch of standalone
// effects. Once the list holds maxDelta chains, or maxDeltaAbove jobs
// above their floors, the shards it touches are written first and the list
// starts over. Loading takes, per chain, the
// later of the two. They are written after the batch's effects were
// delivered, so an entry names jobs whose effects the destination took, or
// (its holes) sent to the dead-letter stream. Written ahead of the
// position is harmless: reading the log again from the saved position
// takes the jobs for duplicates, and a dead-lettered job's effects apply
// on their own, as its replayed dead letters do.

const appliedShards = 256

// maxDelta is how many chains the position record lists, and
// maxDeltaAbove how many jobs above their floors; variables for tests.
var (
	maxDelta      = 256
	maxDeltaAbove = 8192
)

// validate checks an entry read from the state bucket, which anyone with
// access to it can write.
func (e appliedEntry) validate() error {
	switch {
	case leasehold.ValidateScope(e.Scope) != nil:
		return fmt.Errorf("scope %q", e.Scope)
	case e.Partition >= leasehold.MaxPartitions:
		return fmt.Errorf("partition %d", e.Partition)
	case e.Epoch == 0 || e.Epoch > leasehold.MaxEpoch:
		return fmt.Errorf("epoch %d", e.Epoch)
	case e.Subject == "":
		return fmt.Errorf("subject %q", e.Subject)
	case e.Acquisition != "" && leasehold.ValidateAcquisition(e.Acquisition) != nil:
		return fmt.Errorf("acquisition %q", e.Acquisition)
	case len(e.Holes) > maxHoles:
		return fmt.Errorf("%d dead-lettered jobs, above %d", len(e.Holes), maxHoles)
	case len(e.Origins) > maxOrigins:
		return fmt.Errorf("%d jobs applied under their origin's keys, above %d", len(e.Origins), maxOrigins)
	}
	above, err := decodeAbove(e.Job, e.Above)
	if err != nil {
		return fmt.Errorf("jobs above floor %d: %w", e.Job, err)
	}
	if e.Job == 0 && len(above) == 0 {
		return errors.New("no job")
	}
	a := applied{Floor: e.Job, Above: above}
	for _, h := range e.Holes {
		if h == 0 || !a.done(h) {
			return fmt.Errorf("dead-lettered job %d is not applied (floor %d, %d jobs above)", h, e.Job, len(above))
		}
	}
	for _, j := range e.Origins {
		if j == 0 || !a.done(j) {
			return fmt.Errorf("job %d, applied under its origin's keys, is not applied (floor %d, %d jobs above)", j, e.Job, len(above))
		}
	}
	return nil
}

func (e appliedEntry) chain() chainKey {
	return chainKey{fence: leasehold.FenceID{Scope: e.Scope, Partition: e.Partition}, subject: e.Subject}
}

// applied is the entry's chain state; the entry was validated.
func (e appliedEntry) applied() applied {
	above, _ := decodeAbove(e.Job, e.Above)
	return applied{Epoch: e.Epoch, Acquisition: e.Acquisition, Floor: e.Job, Above: above, Holes: e.Holes, Origins: e.Origins}
}

func entryOf(c chainKey, a applied) appliedEntry {
	return appliedEntry{Scope: c.fence.Scope, Partition: c.fence.Partition, Subject: c.subject, Epoch: a.Epoch, Acquisition: a.Acquisition,
		Job: a.Floor, Above: encodeAbove(a.Floor, a.Above), Holes: a.Holes, Origins: a.Origins}
}

// later reports whether a is later than b on one chain: a chain's epochs
// only rise, and within a lease its floor; above the floor its set only
// grows until the floor rises; a job's dead letters are recorded after it.
func (a applied) later(b applied) bool {
	if a.Epoch != b.Epoch {
		return a.Epoch > b.Epoch
	}
	if a.Floor != b.Floor {
		return a.Floor > b.Floor
	}
	if len(a.Above) != len(b.Above) {
		return len(a.Above) > len(b.Above)
	}
	if len(a.Holes) != len(b.Holes) {
		return len(a.Holes) > len(b.Holes)
	}
	return len(a.Origins) > len(b.Origins)
}

// encodeAbove writes the jobs above floor as the member holdings and the
// fence records' done sets are written: ascending deltas (from floor, then
// from the job before) as uvarints, in unpadded URL base64.
func encodeAbove(floor uint64, above []uint64) string {
	if len(above) == 0 {
		return ""
	}
	buf := make([]byte, 0, 2*len(above))
	prev := floor
	for _, j := range above {
		buf = binary.AppendUvarint(buf, j-prev)
		prev = j
	}
	return base64.RawURLEncoding.EncodeToString(buf)
}

// decodeAbove reads what encodeAbove wrote, strictly: each delta at least
// 1 in its shortest form, no job past 2^63, at most maxAbove jobs.
func decodeAbove(floor uint64, s string) ([]uint64, error) {
	if s == "" {
		return nil, nil
	}
	if len(s) > 14*maxAbove {
		return nil, fmt.Errorf("%d characters, more than %d jobs take", len(s), maxAbove)
	}
	b, err := base64.RawURLEncoding.Strict().DecodeString(s)
	if err != nil {
		return nil, err
	}
	var out []uint64
	prev := floor
	for len(b) > 0 {
		d, n := binary.Uvarint(b)
		if n <= 0 || n != len(binary.AppendUvarint(nil, d)) {
			return nil, errors.New("a delta that is no shortest uvarint")
		}
		b = b[n:]
		if d == 0 || d > 1<<63-prev {
			return nil, fmt.Errorf("a delta of %d after job %d", d, prev)
		}
		prev += d
		if out = append(out, prev); len(out) > maxAbove {
			return nil, fmt.Errorf("more than %d jobs", maxAbove)
		}
	}
	return out, nil
}

// deltaEntries lists the jobs applied since the shards were written, in a
// stable order.
func (gs *groups) deltaEntries() []appliedEntry {
	if gs == nil || len(gs.delta) == 0 {
		return nil
	}
	out := make([]appliedEntry, 0, len(gs.delta))
	for c, a := range gs.delta {
		out = append(out, entryOf(c, a))
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Scope != b.Scope {
			return a.Scope < b.Scope
		}
		if a.Partition != b.Partition {
			return a.Partition < b.Partition
		}
		return a.Subject < b.Subject
	})
	return out
}

// adoptApplied makes the loaded shards and the position record's list the
// runner's applied jobs.
func (r *Runner) adoptApplied(ap loadedApplied, delta []appliedEntry) {
	gs := newGroups()
	r.groups = gs
	gs.applied, r.appliedRev = ap.entries, ap.rev
	for _, e := range delta {
		c, a := e.chain(), e.applied()
		if cur, ok := gs.applied[c]; !ok || a.later(cur) {
			gs.applied[c] = a
		}
		gs.delta[c] = gs.applied[c]
	}
	for _, a := range gs.applied {
		gs.above += len(a.Above)
	}
}

// deltaAbove counts the jobs above their floors the position record's
// list would hold.
func (gs *groups) deltaAbove() int {
	n := 0
	for _, a := range gs.delta {
		n += len(a.Above)
	}
	return n
}

// checkpointApplied writes the shards of the chains in the position
// record's list once it is long, so that the list can start over.
func (r *Runner) checkpointApplied(ctx context.Context) error {
	gs := r.groups
	if len(gs.delta) < maxDelta && len(gs.dirty) == 0 && gs.deltaAbove() < maxDeltaAbove {
		return nil
	}
	for c := range gs.delta {
		gs.dirty[appliedShard(c.fence)] = true
	}
	if err := r.saveApplied(ctx); err != nil {
		return err
	}
	clear(gs.delta)
	return nil
}

// appliedValue is the JSON value of an applied shard.
type appliedValue struct {
	Applied []appliedEntry `json:"applied"`
}

type appliedEntry struct {
	Scope       string              `json:"s"`
	Partition   leasehold.Partition `json:"p"`
	Subject     string              `json:"sub"`
	Epoch       leasehold.Epoch     `json:"e"`
	Acquisition string              `json:"a,omitempty"`
	// Job is the chain's floor: every job of the lease up to it is
	// settled on the chain. A runner before floors wrote its last applied
	// job here, which reads as the floor it is.
	Job uint64 `json:"j"`
	// Above is the jobs above the floor applied on the chain, written by
	// encodeAbove.
	Above string `json:"x,omitempty"`
	// Holes are the jobs settled on the chain whose delivery went to the
	// dead-letter stream: not applied (see applied in chains.go).
	Holes []uint64 `json:"h,omitempty"`
	// Origins are the jobs applied on the chain under their origin's
	// keys (see applied in chains.go).
	Origins []uint64 `json:"o,omitempty"`
}

func appliedShard(id leasehold.FenceID) int { return shardOf(id, appliedShards) }

func (r *Runner) appliedKey(k int) string { return r.cfg.Consumer + ".applied." + strconv.Itoa(k) }

type loadedApplied struct {
	entries map[chainKey]applied
	rev     map[int]uint64
}

// loadApplied reads the applied shards through the stream leader. Anyone
// with access to the state bucket can write them: they are checked.
func (r *Runner) loadApplied(ctx context.Context) (loadedApplied, error) {
	out := loadedApplied{entries: map[chainKey]applied{}, rev: map[int]uint64{}}
	prefix := r.kvSubject(r.cfg.Consumer + ".applied.")
	shards := map[int][]appliedEntry{}
	for next := uint64(1); ; {
		rctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
		m, err := r.state.Next(rctx, next, prefix+"*")
		cancel()
		if err != nil {
			return out, fmt.Errorf("streamsink: read the applied jobs of %s/%s: %w", r.cfg.StateBucket, r.cfg.Consumer, err)
		}
		if m == nil {
			break
		}
		next = m.Seq + 1
		name := strings.TrimPrefix(m.Subject, prefix)
		k, err := strconv.Atoi(name)
		if err != nil || k < 0 || k >= appliedShards || strconv.Itoa(k) != name {
			if leader.IsMarker(m.Header) {
				// Deleted or purged, as the error below asks.
				continue
			}
			return out, fmt.Errorf("streamsink: key %s.applied.%s of %s is not one of the runner's applied shards: delete it", r.cfg.Consumer, name, r.cfg.StateBucket)
		}
		out.rev[k] = m.Seq
		delete(shards, k)
		if leader.IsMarker(m.Header) {
			continue
		}
		var v appliedValue
		if err := json.Unmarshal(m.Data, &v); err != nil {
			return out, fmt.Errorf("streamsink: applied shard %s of %s is not leasehold's JSON (%v): fix or delete it, knowing that jobs are then applied again", r.appliedKey(k), r.cfg.StateBucket, err)
		}
		for _, e := range v.Applied {
			err := e.validate()
			if err == nil && appliedShard(e.chain().fence) != k {
				err = fmt.Errorf("fence %s belongs in shard %d", e.chain().fence, appliedShard(e.chain().fence))
			}
			if err != nil {
				return out, fmt.Errorf("streamsink: applied shard %s of %s holds an entry that is not leasehold's (%v): fix or delete it, knowing that jobs are then applied again", r.appliedKey(k), r.cfg.StateBucket, err)
			}
		}
		shards[k] = v.Applied
	}
	for _, es := range shards {
		for _, e := range es {
			out.entries[e.chain()] = e.applied()
		}
	}
	return out, nil
}

// encodeApplied writes shard k, leaving out chains whose fence has risen
// past them for good (at or below the saved position).
func (r *Runner) encodeApplied(k int) []byte {
	var v appliedValue
	for c, a := range r.groups.applied {
		if appliedShard(c.fence) != k {
			continue
		}
		if f, ok := r.fences.fences[c.fence]; ok && f.Epoch > a.Epoch && f.At <= r.saved {
			if _, moving := r.fences.past[c.fence]; !moving {
				r.groups.forgetChain(c)
				continue
			}
		}
		v.Applied = append(v.Applied, entryOf(c, a))
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
	return b.Bytes()
}

// saveApplied writes the applied shards changed since the last save.
func (r *Runner) saveApplied(ctx context.Context) error {
	gs := r.groups
	if len(gs.dirty) == 0 {
		return nil
	}
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		errs []error
		sem  = make(chan struct{}, shardWriters)
	)
	bodies := map[int][]byte{}
	for k := range gs.dirty {
		body := r.encodeApplied(k)
		if len(body) > shardBytes {
			return fmt.Errorf("%w: the applied jobs of shard %d take %d bytes, above the bound of %d: too many fences and subjects carry job effects for this runner; split the log among runners (Config.FilterSubject)", ErrGroupLimit, k, len(body), shardBytes)
		}
		bodies[k] = body
	}
	// The writers touch only their own arguments and written; the runner's
	// maps change after they are all done, so no writer reads a map that
	// another one is writing.
	written := map[int]uint64{}
	for k, body := range bodies {
		wg.Add(1)
		sem <- struct{}{}
		go func(k int, body []byte, rev uint64) {
			defer func() { <-sem; wg.Done() }()
			nrev, err := r.put(ctx, r.appliedKey(k), body, rev)
			if err != nil && isStateConflict(err) {
				nrev, err = r.mine(ctx, r.appliedKey(k), body, err)
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("write applied shard %d: %w", k, err))
				return
			}
			written[k] = nrev
		}(k, body, r.appliedRev[k])
	}
	wg.Wait()
	for k, rev := range written {
		r.appliedRev[k] = rev
		delete(gs.dirty, k)
	}
	return errors.Join(errs...)
}
