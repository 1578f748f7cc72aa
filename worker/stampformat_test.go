package worker_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// mixedSink is a stream sink runner's view of what it applied and refused.
type mixedSink struct {
	mu      sync.Mutex
	applied map[string]int // idempotency key: times the handler ran
	stale   map[string]bool
	changed chan struct{}
}

func (s *mixedSink) note() {
	select {
	case s.changed <- struct{}{}:
	default:
	}
}

// waitFor waits, on the sink's events, until cond holds.
func (s *mixedSink) waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(within)
	for {
		s.mu.Lock()
		ok := cond()
		s.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-s.changed:
		case <-deadline:
			t.Fatalf("%s: not within %v", what, within)
		}
	}
}

// A fleet in the middle of an upgrade: a worker writing the legacy stamp
// (one header per field) and one writing the compact form, side by side
// over the same partitions, feed one stream sink runner. The partitions
// move between them as the second joins and the first leaves. Every job's
// effect is applied exactly once, whichever form it came in, and a stale
// effect is refused in either form.
func TestMixedFleetStampFormats(t *testing.T) {
	e := newEnv(t, 4, natstestListen()...)
	ctx := ctxFor(t, 3*time.Minute)
	s := &mixedSink{applied: map[string]int{}, stale: map[string]bool{}, changed: make(chan struct{}, 1)}
	runSink(t, e, streamsink.Config{
		Progress: e.bucket,
		Handler: func(_ context.Context, eff sink.Effect) error {
			s.mu.Lock()
			s.applied[eff.Stamp.Key]++
			s.mu.Unlock()
			s.note()
			return nil
		},
		Observer: sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
			if d.Outcome == sink.Stale {
				s.mu.Lock()
				s.stale[d.Stamp.Key] = true
				s.mu.Unlock()
				s.note()
			}
		}),
	})

	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error { return j.Emit(ctx, j.Data) })
	oldCfg := e.config("old", h)
	oldCfg.StampFormat = leasehold.StampLegacy
	old := start(t, oldCfg)
	keys := map[string]bool{}
	enqueue := func(from, n int) {
		for _, q := range e.enqueue(t, from, n) {
			keys[leasehold.EffectKey(e.prefix, q.Partition, q.Seq, 0)] = true
		}
	}
	appliedAll := func() bool {
		for k := range keys {
			if s.applied[k] == 0 {
				return false
			}
		}
		return true
	}
	enqueue(0, 100)
	s.waitFor(t, time.Minute, "the legacy worker's effects applied", appliedAll)
	newCfg := e.config("new", h)
	rec := newRecorder()
	newCfg.Observer = rec
	start(t, newCfg)
	// Both hold partitions before the next jobs come: the log then holds
	// both forms side by side.
	rec.waitFor(t, time.Minute, "the compact worker takes a partition", func() bool { return rec.count(kind(worker.EventPartitionReady)) > 0 })
	enqueue(100, 100)
	s.waitFor(t, time.Minute, "both workers' effects applied", appliedAll)
	old.stop(t)
	enqueue(200, 100)
	s.waitFor(t, time.Minute, "the compact worker's effects applied", appliedAll)

	// Both forms are in the log, and nothing else.
	var legacy, compact int
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		_, c := m.Headers()[leasehold.HeaderStamp]
		_, l := m.Headers()[leasehold.HeaderEpoch]
		switch {
		case c && l:
			t.Fatalf("a worker wrote both forms: %v", m.Headers())
		case c:
			compact++
		case l:
			legacy++
		default:
			t.Fatalf("an unstamped message in the log: %v", m.Headers())
		}
	}
	if legacy == 0 || compact == 0 {
		t.Fatalf("the log holds %d legacy and %d compact messages: the fleet was not mixed", legacy, compact)
	}

	// A zombie of an epoch long gone, in either form, is refused.
	for _, f := range []leasehold.StampFormat{leasehold.StampLegacy, leasehold.StampCompact} {
		st := leasehold.Stamp{Scope: e.prefix, Partition: 0, Epoch: 1, Acquisition: "zombie", Key: "zombie-" + f.String(), Worker: "zombie"}
		msg := &nats.Msg{Subject: worker.OutputSubject(e.prefix, 0), Header: nats.Header{}, Data: []byte("stale")}
		st.SetHeaderAs(msg.Header, f)
		if _, err := e.js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	s.waitFor(t, time.Minute, "both zombies refused", func() bool { return s.stale["zombie-legacy"] && s.stale["zombie-compact"] })

	s.mu.Lock()
	defer s.mu.Unlock()
	for k, n := range s.applied {
		switch {
		case !keys[k]:
			t.Errorf("applied %q, which no job emitted", k)
		case n != 1:
			t.Errorf("applied %q %d times", k, n)
		}
	}
	if len(s.applied) != len(keys) {
		t.Errorf("applied %d keys of %d", len(s.applied), len(keys))
	}
	t.Logf("%d jobs applied once each; the log held %d legacy and %d compact messages", len(keys), legacy, compact)
}

// keyOf is the idempotency key of the stamp h carries, in either form; ""
// when it carries none that reads.
func keyOf(h nats.Header) string {
	s, _ := leasehold.StampFromHeader(h)
	return s.Key
}

// markOf is the job mark h carries, in either form; standalone when it
// carries none that reads.
func markOf(h nats.Header) leasehold.JobMark {
	m, _ := leasehold.JobMarkFromHeader(h)
	return m
}
