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
)

// fenceInput is one operation on a fence.
type fenceInput struct {
	op  string // "apply", "advance" or "read"
	id  leasehold.FenceID
	e   leasehold.Epoch
	acq string
}

func (in fenceInput) stamp(key string) leasehold.Stamp {
	return leasehold.Stamp{Scope: in.id.Scope, Partition: in.id.Partition, Epoch: in.e, Acquisition: in.acq, Key: key}
}

// fenceOutput is what the operation returned.
type fenceOutput struct {
	accepted bool                 // apply, advance: nil error
	verdict  leasehold.Verdict    // apply, advance: Stale or SplitBrain when refused
	state    leasehold.FenceState // read: the fence; refused: the fence the error names
}

// fenceModel is the sequential specification of one fence: its state is
// the recorded epoch and acquisition, and leasehold.Judge decides every
// write. A refusal must name the fence as it is at the refusal's
// linearization point.
var fenceModel = porcupine.Model{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		by := map[leasehold.FenceID][]porcupine.Operation{}
		for _, o := range h {
			id := o.Input.(fenceInput).id
			by[id] = append(by[id], o)
		}
		var out [][]porcupine.Operation
		for _, ops := range by {
			out = append(out, ops)
		}
		return out
	},
	Init: func() any { return leasehold.FenceState{} },
	Step: func(state, input, output any) (bool, any) {
		f := state.(leasehold.FenceState)
		in, out := input.(fenceInput), output.(fenceOutput)
		if in.op == "read" {
			return out.state.Epoch == f.Epoch && out.state.Acquisition == f.Acquisition, f
		}
		v, raise := leasehold.Judge(f, in.stamp("k"))
		if out.accepted {
			if v != leasehold.Admit {
				return false, f
			}
			if raise {
				f = leasehold.FenceState{Epoch: in.e, Acquisition: in.acq}
			}
			return true, f
		}
		return v == out.verdict && out.state.Epoch == f.Epoch && out.state.Acquisition == f.Acquisition, f
	},
	DescribeOperation: func(input, output any) string {
		in, out := input.(fenceInput), output.(fenceOutput)
		if in.op == "read" {
			return fmt.Sprintf("read(%s) -> %d/%s", in.id, out.state.Epoch, out.state.Acquisition)
		}
		res := "ok"
		if !out.accepted {
			res = fmt.Sprintf("refused (%s) by %d/%s", sink.Refused(out.verdict), out.state.Epoch, out.state.Acquisition)
		}
		return fmt.Sprintf("%s(%s, %d/%s) -> %s", in.op, in.id, in.e, in.acq, res)
	},
}

// The model itself refuses histories in which a stale or a split-brain
// write is accepted, so the check below is not vacuous.
func TestFenceModelRejectsBadAccepts(t *testing.T) {
	t.Parallel()
	id := leasehold.FenceID{Scope: "a", Partition: 1}
	for name, second := range map[string]fenceInput{
		"stale":       {op: "apply", id: id, e: 3, acq: acq(3)},
		"split brain": {op: "apply", id: id, e: 5, acq: "twin"},
	} {
		h := []porcupine.Operation{
			{ClientId: 0, Input: fenceInput{op: "apply", id: id, e: 5, acq: acq(5)}, Call: 0, Output: fenceOutput{accepted: true}, Return: 1},
			{ClientId: 1, Input: second, Call: 2, Output: fenceOutput{accepted: true}, Return: 3},
		}
		if porcupine.CheckOperations(fenceModel, h) {
			t.Errorf("the model accepts a %s write after epoch 5", name)
		}
	}
}

// A concurrent history of applies, advances and reads against the
// PostgreSQL sink, on the same partitions of two scopes, with some writes
// from a second acquisition of an epoch, is linearizable with respect to
// leasehold.Judge over each fence.
func TestLinearizable(t *testing.T) {
	t.Parallel()
	_, db := startDB(t)
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
				scope := []string{"lin-a", "lin-b"}[rng.IntN(2)]
				in := fenceInput{id: leasehold.FenceID{Scope: scope, Partition: leasehold.Partition(rng.IntN(2))}, e: leasehold.Epoch(1 + i/6 + rng.IntN(3))}
				in.acq = acq(in.e)
				if rng.IntN(10) == 0 {
					in.acq = "twin" + in.e.String()
				}
				var out fenceOutput
				var err error
				call := clock.Add(1)
				switch r := rng.IntN(10); {
				case r < 6:
					in.op = "apply"
					err = s.Apply(ctx, sink.Effect{Stamp: in.stamp(fmt.Sprintf("lin-%d-%d", c, i)), Subject: "s"})
				case r < 7:
					in.op = "advance"
					err = s.Advance(ctx, leasehold.Lease{Scope: scope, Partition: in.id.Partition, Epoch: in.e, Acquisition: in.acq, Holder: "w"})
				default:
					in.op = "read"
					out.state, err = s.Fence(ctx, in.id)
				}
				ret := clock.Add(1)
				var se *leasehold.StaleEpochError
				switch {
				case err == nil:
					out.accepted = true
				case in.op != "read" && errors.As(err, &se):
					out.verdict = leasehold.Stale
					if se.SplitBrain {
						out.verdict = leasehold.SplitBrain
					}
					out.state = leasehold.FenceState{Epoch: se.Max, Acquisition: se.MaxAcquisition}
				default:
					t.Errorf("%s: %v", in.op, err)
					return
				}
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
	counts := map[string]int{}
	for _, o := range history {
		in, out := o.Input.(fenceInput), o.Output.(fenceOutput)
		if in.op != "apply" {
			continue
		}
		switch {
		case out.accepted:
			counts["accepted"]++
		case out.verdict == leasehold.SplitBrain:
			counts["split brain"]++
		default:
			counts["stale"]++
		}
	}
	if counts["accepted"] == 0 || counts["stale"] == 0 || counts["split brain"] == 0 {
		t.Fatalf("applies %v: the history does not exercise the fence", counts)
	}
	t.Logf("linearizable: %d operations; applies %v", len(history), counts)
}
