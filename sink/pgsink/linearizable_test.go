package pgsink_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/testing/pgtest"
)

// fenceInput is one operation on a partition's fence.
type fenceInput struct {
	op string // "apply", "advance" or "read"
	p  leasehold.Partition
	e  leasehold.Epoch
}

// fenceOutput is what the operation returned.
type fenceOutput struct {
	accepted bool            // apply: admitted (nil error)
	max      leasehold.Epoch // read: the maximum
}

// fenceModel is the sequential specification of one partition's fence:
// the state is its recorded maximum.
var fenceModel = porcupine.Model{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		by := map[leasehold.Partition][]porcupine.Operation{}
		for _, o := range h {
			p := o.Input.(fenceInput).p
			by[p] = append(by[p], o)
		}
		var out [][]porcupine.Operation
		for _, ops := range by {
			out = append(out, ops)
		}
		return out
	},
	Init: func() any { return leasehold.Epoch(0) },
	Step: func(state, input, output any) (bool, any) {
		max := state.(leasehold.Epoch)
		in, out := input.(fenceInput), output.(fenceOutput)
		switch in.op {
		case "apply":
			if in.e >= max {
				return out.accepted, in.e
			}
			return !out.accepted, max
		case "advance":
			return true, leasehold.Epoch(maxOf(uint64(max), uint64(in.e)))
		default:
			return out.max == max, max
		}
	},
	DescribeOperation: func(input, output any) string {
		in, out := input.(fenceInput), output.(fenceOutput)
		switch in.op {
		case "apply":
			return fmt.Sprintf("apply(p%d, %d) -> %v", in.p, in.e, out.accepted)
		case "advance":
			return fmt.Sprintf("advance(p%d, %d)", in.p, in.e)
		}
		return fmt.Sprintf("read(p%d) -> %d", in.p, out.max)
	},
}

func maxOf(a, b uint64) uint64 {
	if a > b {
		return a
	}
	return b
}

// The model itself refuses a history in which a stale write is accepted
// after the maximum rose, so the check below is not vacuous.
func TestFenceModelRejectsStaleAccept(t *testing.T) {
	h := []porcupine.Operation{
		{ClientId: 0, Input: fenceInput{op: "apply", p: 1, e: 5}, Call: 0, Output: fenceOutput{accepted: true}, Return: 1},
		{ClientId: 1, Input: fenceInput{op: "apply", p: 1, e: 3}, Call: 2, Output: fenceOutput{accepted: true}, Return: 3},
	}
	if porcupine.CheckOperations(fenceModel, h) {
		t.Fatal("the model accepts a stale write after the maximum rose")
	}
}

// A concurrent history of applies, advances and reads against the
// PostgreSQL sink is linearizable with respect to a per-partition maximum.
func TestLinearizable(t *testing.T) {
	srv := pgtest.Start(t)
	db := pool(t, srv.DSN())
	ctx := ctxFor(t, 3*time.Minute)
	s := newSink(t, db, pgsink.Config{Prefix: "lin_"})
	const clients, opsPer = 6, 60
	var clock atomic.Int64
	var mu sync.Mutex
	var history []porcupine.Operation
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(c), 11))
			for i := range opsPer {
				in := fenceInput{p: leasehold.Partition(rng.IntN(2)), e: leasehold.Epoch(1 + i/6 + rng.IntN(3))}
				var out fenceOutput
				call := clock.Add(1)
				switch r := rng.IntN(10); {
				case r < 6:
					in.op = "apply"
					err := s.Apply(ctx, sink.Effect{
						Stamp:   leasehold.Stamp{Partition: in.p, Epoch: in.e, Key: fmt.Sprintf("lin-%d-%d", c, i)},
						Subject: "s",
					})
					if err != nil && !errors.Is(err, leasehold.ErrStaleEpoch) {
						t.Errorf("apply: %v", err)
						return
					}
					out.accepted = err == nil
				case r < 7:
					in.op = "advance"
					if err := s.Advance(ctx, in.p, in.e); err != nil {
						t.Errorf("advance: %v", err)
						return
					}
				default:
					in.op = "read"
					m, err := s.MaxEpoch(ctx, in.p)
					if err != nil {
						t.Errorf("read: %v", err)
						return
					}
					out.max = m
				}
				ret := clock.Add(1)
				mu.Lock()
				history = append(history, porcupine.Operation{ClientId: c, Input: in, Call: call, Output: out, Return: ret})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	res := porcupine.CheckOperationsTimeout(fenceModel, history, time.Minute)
	if res != porcupine.Ok {
		t.Fatalf("the history of %d operations is not linearizable: %s", len(history), res)
	}
	accepted, rejected := 0, 0
	for _, o := range history {
		if in := o.Input.(fenceInput); in.op == "apply" {
			if o.Output.(fenceOutput).accepted {
				accepted++
			} else {
				rejected++
			}
		}
	}
	if accepted == 0 || rejected == 0 {
		t.Fatalf("%d accepted and %d rejected applies: the history does not exercise the fence", accepted, rejected)
	}
	t.Logf("linearizable: %d operations, %d applies accepted, %d rejected", len(history), accepted, rejected)
}
