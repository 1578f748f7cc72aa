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
// batches and advances read from the fuzzer's bytes, some stamped from raw
// header text as they would arrive off the wire, and checks every answer
// against a model of the fence: an effect is applied only if its stamp is
// valid and its epoch is at least its partition's maximum, a batch is all
// or nothing, a key is applied once, a maximum never goes down, and a
// refusal says which maximum refused it.
func FuzzAdmission(f *testing.F) {
	f.Add([]byte{0, 1, 5, 0, 1, 3, 1, 2, 7, 0, 0, 4}, "7", "k")
	f.Add([]byte{2, 0, 9, 0, 0, 1, 3, 0, 0, 2}, "-1", "")
	f.Add([]byte{1, 1, 1, 1, 1, 1, 1, 1}, "01", "a b")
	f.Add([]byte{3, 3, 3, 0, 200, 255}, "9223372036854775808", "k")
	f.Fuzz(func(t *testing.T, prog []byte, rawEpoch, rawKey string) {
		ctx := context.Background()
		m := sink.NewMemory(sink.MemoryConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		maxOf := map[leasehold.Partition]leasehold.Epoch{}
		applied := map[string]bool{}
		next := func() byte {
			if len(prog) == 0 {
				return 0
			}
			b := prog[0]
			prog = prog[1:]
			return b
		}
		effect := func() sink.Effect {
			p := leasehold.Partition(next() % 3)
			e := leasehold.Epoch(next() % 8)
			key := fmt.Sprintf("k%d", next()%6)
			return sink.Effect{Stamp: leasehold.Stamp{Partition: p, Epoch: e, Key: key}, Subject: key, Data: []byte(key)}
		}
		for step := 0; len(prog) > 0 && step < 64; step++ {
			switch next() % 4 {
			case 0, 1: // one effect, or two as a batch
				batch := []sink.Effect{effect()}
				if step%2 == 1 {
					batch = append(batch, effect())
				}
				check(t, m.Apply(ctx, batch...), batch, maxOf, applied)
			case 2: // an advance
				p, e := leasehold.Partition(next()%3), leasehold.Epoch(next()%8)
				err := m.Advance(ctx, p, e)
				if e == 0 {
					if err == nil {
						t.Fatal("advance to epoch 0 was accepted")
					}
					continue
				}
				if err != nil {
					t.Fatalf("advance %d to %d: %v", p, e, err)
				}
				maxOf[p] = max(maxOf[p], e)
			case 3: // an effect stamped from raw header text
				h := map[string][]string{
					leasehold.HeaderPartition: {fmt.Sprint(next() % 3)},
					leasehold.HeaderEpoch:     {rawEpoch},
					leasehold.HeaderKey:       {rawKey},
				}
				st, err := leasehold.StampFromHeader(h)
				if err != nil {
					continue // a runner terms it; nothing reaches the sink
				}
				batch := []sink.Effect{{Stamp: st, Subject: "raw", Data: []byte(rawKey)}}
				check(t, m.Apply(ctx, batch...), batch, maxOf, applied)
			}
			for p := range leasehold.Partition(3) {
				got, _ := m.MaxEpoch(ctx, p)
				if got != maxOf[p] {
					t.Fatalf("partition %d: max %d, model %d", p, got, maxOf[p])
				}
			}
		}
	})
}

// check compares one Apply's answer with the model, and updates it.
func check(t *testing.T, err error, batch []sink.Effect, maxOf map[leasehold.Partition]leasehold.Epoch, applied map[string]bool) {
	t.Helper()
	next := map[leasehold.Partition]leasehold.Epoch{}
	for p, e := range maxOf {
		next[p] = e
	}
	var want error
	for _, e := range batch {
		if e.Stamp.Validate() != nil {
			want = leasehold.ErrBadStamp
			break
		}
	}
	if want == nil {
		for _, e := range batch {
			if e.Stamp.Epoch < next[e.Stamp.Partition] {
				want = leasehold.ErrStaleEpoch
				break
			}
			next[e.Stamp.Partition] = e.Stamp.Epoch
		}
	}
	switch {
	case want == nil && err != nil:
		t.Fatalf("batch %+v refused: %v (model maxima %v)", batch, err, maxOf)
	case want != nil && !errors.Is(err, want):
		t.Fatalf("batch %+v: error %v, want %v (model maxima %v)", batch, err, want, maxOf)
	case want == nil:
		for p, e := range next {
			maxOf[p] = e
		}
		for _, e := range batch {
			applied[e.Stamp.Key] = true
		}
	case errors.Is(want, leasehold.ErrStaleEpoch):
		var se *leasehold.StaleEpochError
		if !errors.As(err, &se) || se.Max <= se.Epoch || se.Max != next[se.Partition] && se.Max != maxOf[se.Partition] {
			t.Fatalf("stale refusal %+v does not carry the maximum that refused it (model %v)", se, maxOf)
		}
	}
}
