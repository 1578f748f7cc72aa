package sink_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// FuzzAdmission drives the reference sink with a program of effects,
// batches and advances over two scopes, read from the fuzzer's bytes, some
// stamped from raw header text as they would arrive off the wire, and
// checks every answer against a model of the fence written out here: an
// effect is applied only if its stamp is valid and its epoch is above its
// fence's, or equal from the acquisition that set it; a batch is all or
// nothing; a (scope, key) is applied once; a fence never goes down; scopes
// never affect each other; and a refusal says which fence refused it.
func FuzzAdmission(f *testing.F) {
	f.Add([]byte{0, 1, 5, 0, 1, 3, 1, 2, 7, 0, 0, 4}, "7", "k")
	f.Add([]byte{2, 0, 9, 0, 0, 1, 3, 0, 0, 2}, "-1", "")
	f.Add([]byte{1, 1, 1, 1, 1, 1, 1, 1}, "01", "a b")
	f.Add([]byte{3, 3, 3, 0, 200, 255}, "9223372036854775808", "k")
	f.Fuzz(func(t *testing.T, prog []byte, rawEpoch, rawKey string) {
		ctx := context.Background()
		m := sink.NewMemory(sink.MemoryConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		model := fenceModel{fences: map[leasehold.FenceID]leasehold.FenceState{}, applied: map[[2]string]bool{}}
		next := func() byte {
			if len(prog) == 0 {
				return 0
			}
			b := prog[0]
			prog = prog[1:]
			return b
		}
		scopes := []string{"orders", "billing/report"}
		stamp := func() leasehold.Stamp {
			b := next()
			return leasehold.Stamp{
				Scope:       scopes[b%2],
				Partition:   leasehold.Partition(next() % 3),
				Epoch:       leasehold.Epoch(next() % 8),
				Acquisition: []string{"x", "y"}[b/2%2],
				Key:         fmt.Sprintf("k%d", next()%6),
			}
		}
		for step := 0; len(prog) > 0 && step < 64; step++ {
			switch next() % 4 {
			case 0, 1: // one effect, or two as a batch
				st := stamp()
				batch := []sink.Effect{{Stamp: st, Subject: st.Key, Data: []byte(st.Key)}}
				if step%2 == 1 {
					st := stamp()
					batch = append(batch, sink.Effect{Stamp: st, Subject: st.Key, Data: []byte(st.Key)})
				}
				model.apply(t, m.Apply(ctx, batch...), batch)
			case 2: // an advance
				st := stamp()
				l := leasehold.Lease{Scope: st.Scope, Partition: st.Partition, Epoch: st.Epoch, Acquisition: st.Acquisition, Holder: "w"}
				model.advance(t, m.Advance(ctx, l), l)
			case 3: // an effect stamped from raw header text, in either form
				p := fmt.Sprint(next() % 3)
				h := map[string][]string{
					leasehold.HeaderStamp: {"1 orders " + p + " " + rawEpoch + " x " + rawKey},
				}
				if next()%2 == 0 {
					h = map[string][]string{
						leasehold.HeaderScope:       {"orders"},
						leasehold.HeaderPartition:   {p},
						leasehold.HeaderEpoch:       {rawEpoch},
						leasehold.HeaderAcquisition: {"x"},
						leasehold.HeaderKey:         {rawKey},
					}
				}
				st, err := leasehold.StampFromHeader(h)
				if err != nil {
					continue // a runner terms it; nothing reaches the sink
				}
				batch := []sink.Effect{{Stamp: st, Subject: "raw", Data: []byte(rawKey)}}
				model.apply(t, m.Apply(ctx, batch...), batch)
			}
			for _, sc := range scopes {
				for p := range leasehold.Partition(3) {
					id := leasehold.FenceID{Scope: sc, Partition: p}
					got, _ := m.Fence(ctx, id)
					if want := model.fences[id]; got.Epoch != want.Epoch || got.Acquisition != want.Acquisition {
						t.Fatalf("%s: fence %+v, model %+v", id, got, want)
					}
				}
			}
		}
	})
}

// fenceModel is the fence contract, written out independently of
// leasehold.Judge.
type fenceModel struct {
	fences  map[leasehold.FenceID]leasehold.FenceState
	applied map[[2]string]bool
}

// admits returns the error class a write of s meets under f, and f as the
// write leaves it.
func admits(f leasehold.FenceState, s leasehold.Stamp) (error, leasehold.FenceState) {
	switch {
	case s.Epoch > f.Epoch || (s.Epoch == f.Epoch && f.Acquisition == ""):
		return nil, leasehold.FenceState{Epoch: s.Epoch, Acquisition: s.Acquisition}
	case s.Epoch == f.Epoch && s.Acquisition == f.Acquisition:
		return nil, f
	case s.Epoch == f.Epoch:
		return leasehold.ErrSplitBrain, f
	}
	return leasehold.ErrStaleEpoch, f
}

func (m *fenceModel) apply(t *testing.T, err error, batch []sink.Effect) {
	t.Helper()
	next := map[leasehold.FenceID]leasehold.FenceState{}
	get := func(id leasehold.FenceID) leasehold.FenceState {
		if f, ok := next[id]; ok {
			return f
		}
		return m.fences[id]
	}
	var want error
	var refusedBy leasehold.FenceState
	for _, e := range batch {
		if e.Stamp.Validate() != nil {
			want = leasehold.ErrBadStamp
			break
		}
	}
	if want == nil {
		for _, e := range batch {
			f := get(e.Stamp.Fence())
			var nf leasehold.FenceState
			if want, nf = admits(f, e.Stamp); want != nil {
				refusedBy = f
				break
			}
			next[e.Stamp.Fence()] = nf
		}
	}
	switch {
	case want == nil && err != nil:
		t.Fatalf("batch %+v refused: %v (model %v)", batch, err, m.fences)
	case want != nil && !errors.Is(err, want):
		t.Fatalf("batch %+v: error %v, want %v (model %v)", batch, err, want, m.fences)
	case want == nil:
		for id, f := range next {
			m.fences[id] = f
		}
		for _, e := range batch {
			m.applied[[2]string{e.Stamp.Scope, e.Stamp.Key}] = true
		}
	case errors.Is(want, leasehold.ErrStaleEpoch):
		var se *leasehold.StaleEpochError
		if !errors.As(err, &se) || se.Max != refusedBy.Epoch || se.SplitBrain != errors.Is(want, leasehold.ErrSplitBrain) {
			t.Fatalf("refusal %+v does not carry the fence that refused it (%+v)", se, refusedBy)
		}
	}
}

func (m *fenceModel) advance(t *testing.T, err error, l leasehold.Lease) {
	t.Helper()
	s := l.Stamp("advance")
	if s.Validate() != nil {
		if err == nil {
			t.Fatalf("advance with an invalid lease %+v was accepted", l)
		}
		return
	}
	want, nf := admits(m.fences[l.Fence()], s)
	if want == nil && err != nil || want != nil && !errors.Is(err, want) {
		t.Fatalf("advance %+v: %v, want %v (model %v)", l, err, want, m.fences)
	}
	if want == nil {
		m.fences[l.Fence()] = nf
	}
}
