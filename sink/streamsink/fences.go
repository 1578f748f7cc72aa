package streamsink

import (
	"errors"
	"fmt"
	"hash/fnv"

	"github.com/leasehold/leasehold"
)

// The runner's fences are judged by log position: a message at position s
// is judged against each fence as it stood just before s. That is what lets
// the fences be saved apart from the position, in a bounded number of
// shards: a runner that saved fences and died before it saved the position
// decides the unsaved messages again, against the fences as they stood at
// the saved position, and reaches the same decisions.
//
// So each fence's saved record is a short history of rises. Entries at or
// below the saved position tell the fence as of that position (only the
// newest of them matters, and it is the only one kept); an entry above it
// was written by a runner that did not live to save its position, and is
// ignored until the messages up to it are decided again. A record never
// holds more than two entries: the fence as of the saved position, and the
// fence as the batch being saved leaves it.

const (
	// DefaultMaxFences is Config.MaxFences' default.
	DefaultMaxFences = 1 << 17
	// MaxFencesLimit is the largest Config.MaxFences: the shards hold that
	// many fences of the longest scope and holder names within their
	// bounds, spread evenly.
	MaxFencesLimit = 1 << 18

	// numShards is how many KV keys hold the fences. A fence's shard is
	// fixed by a hash of its ID (shardOf); the count is part of the saved
	// format. A shard is written when one of its fences rises, so more,
	// smaller shards write fewer bytes per rise; a runner reads the
	// shards that exist when it starts.
	numShards = 4096
	// shardBytes bounds one shard's value, well under the server's
	// default max payload of 1 MiB. A fence that would take its shard
	// beyond it is refused like one beyond MaxFences.
	shardBytes = 128 << 10
	// maxHolderLen bounds the holder a fence records: the longest worker
	// ID leasehold issues. The holder is informative, and a barrier can
	// carry any Leasehold-Worker header.
	maxHolderLen = 128
)

// ErrFenceLimit is matched by the error of an effect or barrier refused
// because it would create a fence beyond the runner's bounds: more than
// Config.MaxFences fences, or a shard of saved fences beyond its size.
// Nothing was applied and the runner went on; the effect stays in the log.
var ErrFenceLimit = errors.New("streamsink: fence limit reached")

// FenceLimitError reports an effect refused by ErrFenceLimit.
type FenceLimitError struct {
	Fence leasehold.FenceID
	Key   string
	// Fences is how many fences the runner keeps, Max its limit; Shard is
	// set when the fence's shard was full although the limit was not
	// reached.
	Fences, Max int
	Shard       bool
}

func (e *FenceLimitError) Error() string {
	if e.Shard {
		return fmt.Sprintf("streamsink: fence %s (key %q) was refused: its shard of saved fences is full (%d bytes) although the runner keeps %d of %d fences; so many scopes with one shard are unlikely except from forged stamps: turn on verified epochs, and use a fresh state bucket to redistribute",
			e.Fence, e.Key, shardBytes, e.Fences, e.Max)
	}
	return fmt.Sprintf("streamsink: fence %s (key %q) was refused: the runner keeps %d fences, its limit of %d (Config.MaxFences); raise it, or turn on verified epochs if stamps of unknown scopes are forged",
		e.Fence, e.Key, e.Fences, e.Max)
}

// Is makes errors.Is(err, ErrFenceLimit) true.
func (e *FenceLimitError) Is(target error) bool { return target == ErrFenceLimit }

// rise is one entry of a fence's history: from log position At on (the
// message at At included), the fence stood at this epoch and acquisition.
type rise struct {
	At          uint64          `json:"at"`
	Epoch       leasehold.Epoch `json:"e"`
	Acquisition string          `json:"a,omitempty"`
	Holder      string          `json:"w,omitempty"`
}

func (r rise) state() leasehold.FenceState {
	return leasehold.FenceState{Epoch: r.Epoch, Acquisition: r.Acquisition, Holder: r.Holder}
}

// holderOf is the holder a fence records for a stamp's worker: printable
// ASCII that JSON writes as is, at most maxHolderLen bytes.
func holderOf(worker string) string {
	if len(worker) > maxHolderLen {
		worker = worker[:maxHolderLen]
	}
	for i := 0; i < len(worker); i++ {
		if c := worker[i]; c < ' ' || c >= 0x7f || c == '"' || c == '\\' {
			b := []byte(worker)
			for j := i; j < len(b); j++ {
				if c := b[j]; c < ' ' || c >= 0x7f || c == '"' || c == '\\' {
					b[j] = '?'
				}
			}
			return string(b)
		}
	}
	return worker
}

// shardOf is the shard that holds fence id: FNV-1a of the scope, a zero
// byte and the partition in four bytes, modulo n.
func shardOf(id leasehold.FenceID, n int) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(id.Scope))
	p := uint32(id.Partition)
	_, _ = h.Write([]byte{0, byte(p >> 24), byte(p >> 16), byte(p >> 8), byte(p)})
	return int(h.Sum32() % uint32(n))
}

// Worst-case bytes of one fence in a shard's JSON (see encodeShard): its
// scope as an object key, its partition as a key, and two entries of the
// largest position, epoch, acquisition and holder.
const (
	scopeOverhead = len(`"":{},`)
	fenceOverhead = len(`"65535":[],`)
	riseBytes     = len(`{"at":18446744073709551615,"e":9223372036854775807,"a":"","w":""},`) + leasehold.MaxAcquisitionLen + maxHolderLen
	shardEnvelope = len(`{"fences":{}}` + "\n")
)

// reserve is what fence id may take in its shard, whatever it records: its
// scope is counted once per fence, so the bound holds even when every
// fence of a shard has a scope of its own.
func reserve(id leasehold.FenceID) int {
	n := scopeOverhead + fenceOverhead + 2*riseBytes
	for i := 0; i < len(id.Scope); i++ {
		n++
		if c := id.Scope[i]; c == '"' || c == '\\' {
			n++
		}
	}
	return n
}

// fenceTable is the runner's fences as of its saved position, and what it
// knows of their shards' keys. Only Run's goroutine changes it, under
// Runner.mu; other goroutines read it under Runner.mu.
type fenceTable struct {
	n        int // shards
	fences   map[leasehold.FenceID]rise
	members  [][]leasehold.FenceID // by shard
	reserved []int                 // bytes reserved by shard
	rev      []uint64              // revision of each shard's key: 0 when it never held anything
	// stale lists the shards whose saved value holds entries above the
	// saved position, or fences that are no more: each is written again
	// before the position next moves, so that no such entry is ever
	// taken for one below it.
	stale map[int]bool
	// past keeps, while the saved position is held back behind the one
	// decided (open job groups, see groups.go), each risen fence's earlier
	// states since the saved position, the state as of it first: what a
	// shard saves as the fence as of the saved position.
	past map[leasehold.FenceID][]rise
}

func newFenceTable(n int) *fenceTable {
	return &fenceTable{
		n: n, fences: make(map[leasehold.FenceID]rise), past: make(map[leasehold.FenceID][]rise),
		members: make([][]leasehold.FenceID, n), reserved: make([]int, n), rev: make([]uint64, n),
		stale: make(map[int]bool),
	}
}

// add records a fence the table did not hold.
func (t *fenceTable) add(id leasehold.FenceID, r rise) {
	k := shardOf(id, t.n)
	t.fences[id] = r
	t.members[k] = append(t.members[k], id)
	t.reserved[k] += reserve(id)
}

// work is a batch being decided: the position reached, and the fences that
// rose since the saved position, as they stand at it.
type work struct {
	seq    uint64
	raised map[leasehold.FenceID]rise
	shards map[int][]leasehold.FenceID // the fences in raised, by shard
	added  int                         // fences in raised that the table does not hold
	extra  map[int]int                 // bytes those reserve, by shard
	// grouped: the batch placed effects in job groups, or dropped some.
	grouped bool
}

// fence returns id's state as of w.seq, and whether the fence exists.
func (w *work) fence(t *fenceTable, id leasehold.FenceID) (rise, bool) {
	if r, ok := w.raised[id]; ok {
		return r, true
	}
	r, ok := t.fences[id]
	return r, ok
}

// room returns nil if fence id, which exists neither in t nor in w, may be
// created, and the refusal otherwise.
func (w *work) room(t *fenceTable, id leasehold.FenceID, key string, max int) error {
	have := len(t.fences) + w.added
	if have >= max {
		return &FenceLimitError{Fence: id, Key: key, Fences: have, Max: max}
	}
	k := shardOf(id, t.n)
	if shardEnvelope+t.reserved[k]+w.extra[k]+reserve(id) > shardBytes {
		return &FenceLimitError{Fence: id, Key: key, Fences: have, Max: max, Shard: true}
	}
	return nil
}

// raise records that fence id rose at position at.
func (w *work) raise(t *fenceTable, id leasehold.FenceID, r rise) {
	if w.raised == nil {
		w.raised = make(map[leasehold.FenceID]rise)
		w.shards = make(map[int][]leasehold.FenceID)
	}
	if _, inBatch := w.raised[id]; !inBatch {
		k := shardOf(id, t.n)
		w.shards[k] = append(w.shards[k], id)
		if _, inTable := t.fences[id]; !inTable {
			w.added++
			if w.extra == nil {
				w.extra = make(map[int]int)
			}
			w.extra[k] += reserve(id)
		}
	}
	w.raised[id] = r
}

// dirty lists the shards a save of w must write before its position.
func (w *work) dirty(t *fenceTable) []int {
	if len(w.raised) == 0 && len(t.stale) == 0 {
		return nil
	}
	set := make(map[int]bool, len(w.shards)+len(t.stale))
	for k := range t.stale {
		set[k] = true
	}
	for k := range w.shards {
		set[k] = true
	}
	out := make([]int, 0, len(set))
	for k := range set {
		out = append(out, k)
	}
	return out
}

// history returns the entries shard k saves for its fences when w is saved
// at position saved: each fence as of saved, and as w leaves it.
func (w *work) history(t *fenceTable, k int, saved uint64) map[leasehold.FenceID][]rise {
	out := make(map[leasehold.FenceID][]rise, len(t.members[k]))
	for _, id := range t.members[k] {
		latest := t.fences[id]
		if r, ok := w.raised[id]; ok {
			latest = r
		}
		if first, ok := t.asOf(id, saved); ok && first != latest {
			out[id] = []rise{first, latest}
		} else {
			out[id] = []rise{latest}
		}
	}
	for _, id := range w.shards[k] {
		if _, ok := out[id]; !ok {
			out[id] = []rise{w.raised[id]}
		}
	}
	return out
}

// asOf returns fence id as it stood at position seq, if it existed.
func (t *fenceTable) asOf(id leasehold.FenceID, seq uint64) (rise, bool) {
	cur, ok := t.fences[id]
	if !ok || cur.At <= seq {
		return cur, ok
	}
	past := t.past[id]
	for i := len(past) - 1; i >= 0; i-- {
		if past[i].At <= seq {
			return past[i], true
		}
	}
	return rise{}, false
}

// commit makes w the table's state, once w is saved at position saved
// (below w.seq while job groups are open): the shards written for it hold
// nothing above saved any more but what history wrote for w.
func (t *fenceTable) commit(w *work, written []int, saved uint64) {
	for id, r := range w.raised {
		if old, ok := t.fences[id]; ok {
			if r.At > saved {
				t.past[id] = append(t.past[id], old)
			}
			t.fences[id] = r
		} else {
			if r.At > saved {
				t.past[id] = t.past[id][:0:0]
			}
			t.add(id, r)
		}
	}
	for id, past := range t.past {
		if t.fences[id].At <= saved {
			delete(t.past, id)
			continue
		}
		i := 0
		for i+1 < len(past) && past[i+1].At <= saved {
			i++
		}
		t.past[id] = past[i:]
	}
	for _, k := range written {
		delete(t.stale, k)
	}
}
