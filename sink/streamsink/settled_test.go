package streamsink_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

// deadLetters reads the sink's dead letters.
func (mw *markerWorld) deadLetters() []*jetstream.RawStreamMsg {
	mw.t.Helper()
	return readLog(mw.t, mw.js, mw.prefix+"-sink-dlq")
}

// replay publishes a dead letter back into the effect log as `leasehold
// dlq replay` does: leasehold's headers but the sink's, and trace
// context; without the job headers when standalone.
func (mw *markerWorld) replay(dl *jetstream.RawStreamMsg, standalone bool) uint64 {
	mw.t.Helper()
	h := nats.Header{}
	for k, vs := range dl.Header {
		if strings.HasPrefix(k, "Leasehold-") && !strings.HasPrefix(k, "Leasehold-Sink-") || strings.EqualFold(k, "traceparent") {
			h[k] = vs
		}
	}
	if standalone {
		leasehold.JobMark{}.SetHeader(h)
	}
	return mw.publish(dl.Header.Get(streamsink.HeaderSinkSubject), h, dl.Data)
}

// Effects whose delivery the destination refuses (ErrPoison) go to the
// dead-letter stream, and a replay of the dead letter is applied: with the
// job headers or without them, for a job of one effect and for the first
// effect of a job of two, by the runner that dead-lettered them and by one
// that started after it from its saved state. Each is applied exactly
// once, and never reported a duplicate while it was not applied. (A runner
// that recorded a job as applied when it decided it took the replay with
// job headers for a duplicate, and the dead letter was gone.)
func TestPoisonedDeliveryReplayed(t *testing.T) {
	for _, restart := range []bool{false, true} {
		t.Run(map[bool]string{false: "same-runner", true: "restarted"}[restart], func(t *testing.T) {
			if restart {
				// What was dead-lettered is saved in the applied shards.
				defer streamsink.SetMaxDelta(1)()
			}
			testPoisonedDeliveryReplayed(t, restart)
		})
	}
}

func testPoisonedDeliveryReplayed(t *testing.T, restart bool) {
	mw := newMarkerWorld(t, "single", "poison", 3, nil, func(ctx context.Context, j *worker.Job) error {
		n := 1
		if string(j.Data) == "pair" {
			n = 2
		}
		for i := range n {
			if err := j.Emit(ctx, []byte(fmt.Sprintf("%s-%d", j.Data, i))); err != nil {
				return err
			}
		}
		return nil
	})
	poisoned := map[string]bool{}
	mw.mu.Lock()
	mw.refuse = func(e sink.Effect) error {
		if !strings.HasSuffix(e.Stamp.Key, ".0") || poisoned[e.Stamp.Key] {
			return nil
		}
		poisoned[e.Stamp.Key] = true
		return fmt.Errorf("the destination refuses %s: %w", e.Stamp.Key, streamsink.ErrPoison)
	}
	mw.mu.Unlock()
	withHeaders := mw.enqueue("one")
	standalone := mw.enqueue("alone")
	pair := mw.enqueue("pair")
	mw.awaitCommitted(pair)
	mw.awaitApplied(map[string]string{leasehold.EffectKey(mw.prefix, 0, pair, 1): "pair-1"})
	dls := mw.deadLetters()
	if len(dls) != 3 {
		t.Fatalf("%d dead letters, want the three first effects", len(dls))
	}
	if restart {
		mw.settle()
		if err := mw.sink.stop(); err != nil {
			t.Fatal(err)
		}
		mw.sink = start(t, mw.js, mw.cfg)
	}
	replayed := map[uint64]bool{}
	for _, dl := range dls {
		key := dl.Header.Get(leasehold.HeaderKey)
		replayed[mw.replay(dl, key == leasehold.EffectKey(mw.prefix, 0, standalone, 0))] = true
	}
	want := map[string]string{
		leasehold.EffectKey(mw.prefix, 0, withHeaders, 0): "one-0",
		leasehold.EffectKey(mw.prefix, 0, standalone, 0):  "alone-0",
		leasehold.EffectKey(mw.prefix, 0, pair, 0):        "pair-0",
		leasehold.EffectKey(mw.prefix, 0, pair, 1):        "pair-1",
	}
	mw.awaitApplied(want)
	mw.mu.Lock()
	defer mw.mu.Unlock()
	applied := map[string]bool{}
	for _, d := range mw.decisions {
		if d.Outcome == sink.Accepted {
			applied[d.Stamp.Key] = true
		}
		if d.Outcome == sink.Duplicate && !applied[d.Stamp.Key] {
			t.Errorf("position %d (key %s, a replay: %v) was reported a duplicate while nothing of it was applied", d.Position, d.Stamp.Key, replayed[d.Position])
		}
	}
}

// Retries, dead letters and rewinds under a runner that reads committed
// progress: a job whose first attempt fails after emitting is applied
// once, from its retry; a job that fails every attempt applies nothing
// and the next job applies; a job whose final the log refused runs again
// (a rewind, which sends no abort marker) and is applied once, from the
// run that completed. The worker runs its jobs in its default order;
// TestRewindOfJobsDoneOutOfOrder runs them with no order at all.
func TestRetriesDeadLettersAndRewinds(t *testing.T) {
	t.Parallel()
	retriesDeadLettersAndRewinds(t, worker.OrderKey)
}

// The same with any job of the partition running beside any other. The
// rewind's runs could complete in another order than the first runs did,
// and then a job's first complete attempt could name in Leasehold-After a
// job whose only complete attempt named it back: the runner, which applies
// a job's attempts in the order they first appeared, waited on both for
// good. The worker replays the jobs whose finals it sent in the order they
// completed, so every final of a job names the same job.
func TestRewindOfJobsDoneOutOfOrder(t *testing.T) {
	t.Parallel()
	retriesDeadLettersAndRewinds(t, worker.OrderNone)
}

func retriesDeadLettersAndRewinds(t *testing.T, order worker.Order) {
	const limit = 4096 // bytes: a final larger than this is refused by the log
	var mu sync.Mutex
	runs := map[uint64]int{}
	mw := newMarkerWorldOrdered(t, "single", "retry", 2, nil, order, func(ctx context.Context, j *worker.Job) error {
		mu.Lock()
		runs[j.Seq]++
		n := runs[j.Seq]
		mu.Unlock()
		last := []byte(fmt.Sprintf("%s-1", j.Data))
		if string(j.Data) == "rewind" && n == 1 {
			last = append(last, make([]byte, 2*limit)...)
		}
		if err := j.Emit(ctx, []byte(fmt.Sprintf("%s-0", j.Data))); err != nil {
			return err
		}
		if err := j.Emit(ctx, last); err != nil {
			return err
		}
		switch {
		case string(j.Data) == "retry" && n == 1, string(j.Data) == "dead":
			return fmt.Errorf("attempt %d of %s fails", n, j.Data)
		}
		return nil
	})
	ctx := ctxFor(t, 30*time.Second)
	s, err := mw.js.Stream(ctx, worker.EffectsStream(mw.prefix))
	if err != nil {
		t.Fatal(err)
	}
	sc := s.CachedInfo().Config
	sc.MaxMsgSize = limit
	if _, err := mw.js.UpdateStream(ctx, sc); err != nil {
		t.Fatal(err)
	}
	retry := mw.enqueue("retry")
	dead := mw.enqueue("dead")
	rewind := mw.enqueue("rewind")
	good := mw.enqueue("good")
	mw.awaitCommitted(good)
	want := map[string]string{}
	for _, seq := range []uint64{retry, rewind, good} {
		for k, v := range mw.wantKeys(seq, 2, map[uint64]string{retry: "retry", rewind: "rewind", good: "good"}[seq]) {
			want[k] = v
		}
	}
	mw.awaitApplied(want)
	mu.Lock()
	if runs[rewind] < 2 {
		t.Errorf("the rewound job ran %d times, want a second run", runs[rewind])
	}
	mu.Unlock()
	mw.mu.Lock()
	defer mw.mu.Unlock()
	for k := range mw.applied {
		if _, ok := want[k]; !ok {
			t.Errorf("effect %s was applied; only the completed attempts' are (dead-lettered job %d)", k, dead)
		}
	}
}

// A long run of jobs that fail every attempt after emitting, with a small
// bound on held effects: their attempts are held only until the fence
// record shows the jobs committed (dead-lettered), so the runner never
// reaches the bound, holds nothing once they are all committed, and its
// saved position moves past them.
func TestFailingJobsDoNotHoldTheRunner(t *testing.T) {
	t.Parallel()
	logs := &lockedBuffer{}
	mw := newMarkerWorld(t, "single", "failing", 2, func(c *streamsink.Config) {
		c.MaxHeldEffects = 120
		c.Logger = slogTo(logs)
	}, func(ctx context.Context, j *worker.Job) error {
		for i := range 2 {
			if err := j.Emit(ctx, []byte(fmt.Sprintf("%s-%d", j.Data, i))); err != nil {
				return err
			}
		}
		return errors.New("this job always fails")
	})
	const jobs = 60 // 4 effects each (two attempts of two), 240 in all
	var last uint64
	for i := range jobs {
		last = mw.enqueue(fmt.Sprint("job", i))
	}
	mw.awaitCommitted(last)
	mw.settle()
	logPos := func() uint64 {
		s, err := mw.js.Stream(ctxFor(t, 10*time.Second), worker.EffectsStream(mw.prefix))
		if err != nil {
			t.Fatal(err)
		}
		return s.CachedInfo().State.LastSeq
	}
	end := logPos()
	deadline := time.Now().Add(30 * time.Second)
	for {
		held := sinkMetric(t, mw.reader, mw.prefix, "leasehold.sink.job_effects_held")
		saved := savedPosition(t, mw.js, mw.prefix)
		if held == 0 && saved >= end {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("30 s after the last job was committed the runner holds %d effects and its saved position is %d, want 0 and %d", held, saved, end)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if strings.Contains(logs.String(), streamsink.ErrGroupLimit.Error()) {
		t.Errorf("the runner reached its held-effects bound:\n%s", logs.String())
	}
	mw.mu.Lock()
	defer mw.mu.Unlock()
	if len(mw.applied) != 0 {
		t.Errorf("effects of failed attempts were applied: %v", mw.applied)
	}
}

// savedPosition reads the position the runner saved for a restart.
func savedPosition(t *testing.T, js jetstream.JetStream, prefix string) uint64 {
	t.Helper()
	var p struct {
		Seq uint64 `json:"seq"`
	}
	if err := json.Unmarshal(savedState(t, js, prefix), &p); err != nil {
		t.Fatal(err)
	}
	return p.Seq
}

// slogTo logs into b.
func slogTo(b *lockedBuffer) *slog.Logger { return slog.New(slog.NewTextHandler(b, nil)) }

// failingReader reads committed progress through inner, or fails while
// failing is set: the fence records out of reach.
type failingReader struct {
	inner   sink.ProgressReader
	failing atomic.Bool
	asked   atomic.Int64
}

func (f *failingReader) Committed(ctx context.Context, id leasehold.FenceID) (sink.Progress, error) {
	f.asked.Add(1)
	if f.failing.Load() {
		return sink.Progress{}, errors.New("the fence-record bucket is out of reach")
	}
	return f.inner.Committed(ctx, id)
}

// While the fence records cannot be read, a job whose retry waits on them
// is held, and once that has lasted Config.StallAfter Ready says why; once
// they can be read again, the job is applied and Ready is nil.
func TestProgressReadFailureShowsInReady(t *testing.T) {
	t.Parallel()
	var reader *failingReader
	var mu sync.Mutex
	runs := map[uint64]int{}
	mw := newMarkerWorld(t, "single", "unread", 3, func(c *streamsink.Config) {
		reader = &failingReader{inner: c.Verifier.(sink.ProgressReader)}
		reader.failing.Store(true)
		c.Progress, c.StallAfter = reader, time.Second
	}, func(ctx context.Context, j *worker.Job) error {
		mu.Lock()
		runs[j.Seq]++
		n := runs[j.Seq]
		mu.Unlock()
		for i := range 2 {
			if err := j.Emit(ctx, []byte(fmt.Sprintf("%s-%d", j.Data, i))); err != nil {
				return err
			}
		}
		if n == 1 {
			return errors.New("the first attempt fails")
		}
		return nil
	})
	seq := mw.enqueue("job")
	mw.awaitCommitted(seq)
	mw.settle()
	ctx := ctxFor(t, time.Minute)
	err := awaitReady(t, ctx, mw.sink.Runner, "Ready to report the unread records", func(err error) bool { return err != nil })
	if err == nil || !strings.Contains(err.Error(), "committed progress") {
		t.Fatalf("Ready: %v, want it to say the committed progress cannot be read", err)
	}
	if reader.asked.Load() == 0 {
		t.Fatal("the runner never asked for the committed progress")
	}
	mw.mu.Lock()
	if len(mw.applied) != 0 {
		t.Errorf("applied %v while the retry waits on the records", mw.applied)
	}
	mw.mu.Unlock()
	reader.failing.Store(false)
	mw.awaitApplied(mw.wantKeys(seq, 2, "job"))
	if err := awaitReady(t, ctx, mw.sink.Runner, "Ready to recover", func(err error) bool { return err == nil }); err != nil {
		t.Errorf("Ready after the records came back: %v", err)
	}
}
