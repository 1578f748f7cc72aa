package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// Two operators run `leasehold dlq replay --all` at the same moment over
// the same dead letter. Each publishes the replay under the message ID
// derived from the dead letter, so the job stream stores one; the job
// runs once more, its effect is applied once, and no dead letter is left.
// The test fails if the job is stored or run twice, its effect applied
// other than once, or a dead letter is left.
func TestAttackConcurrentReplaysStoreOneJob(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rw := newReplayWorld(t, ctx, "cr")
	var failing atomic.Bool
	failing.Store(true)
	var mu sync.Mutex
	runs := 0
	prog, _ := rw.startWorker(t, "w", 1, func(ctx context.Context, j *worker.Job) error {
		if string(j.Data) == "doomed" {
			if failing.Load() {
				return errors.New("the ledger is closed for the night")
			}
			mu.Lock()
			runs++
			mu.Unlock()
		}
		return j.Emit(ctx, []byte(fmt.Sprintf("credit of %s", j.Data)))
	})
	p, err := worker.NewProducer(rw.js, worker.ProducerConfig{Prefix: rw.prefix, Partitions: 1, Bucket: rw.bucket})
	if err != nil {
		t.Fatal(err)
	}
	doomed, err := p.Enqueue(ctx, []byte("a"), []byte("doomed"))
	if err != nil {
		t.Fatal(err)
	}
	prog.wait(t, ctx, 0, doomed.Seq)
	failing.Store(false)

	outs := make([]string, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-gate
			outs[i], errs[i] = run(t, ctx, "dlq", "replay", "--all", "--nats", rw.url, "--prefix", rw.prefix)
		}()
	}
	close(gate)
	wg.Wait()
	for i := range 2 {
		t.Logf("replay %d: err %v\n%s", i, errs[i], outs[i])
	}
	js, err := rw.js.Stream(ctx, worker.JobsStream(rw.prefix))
	if err != nil {
		t.Fatal(err)
	}
	info, err := js.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.LastSeq != doomed.Seq+1 {
		t.Fatalf("the job stream ends at %d: want one replay stored after job %d", info.State.LastSeq, doomed.Seq)
	}
	prog.wait(t, ctx, 0, info.State.LastSeq)
	rw.settle(t, ctx)
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	rw.wantOnce(t, wctx, leasehold.EffectKey(rw.prefix, 0, doomed.Seq, 0), "the replayed job")
	mu.Lock()
	n := runs
	mu.Unlock()
	if n != 1 {
		t.Errorf("the replayed job ran %d times after the fix, want once", n)
	}
	dl, err := rw.js.Stream(ctx, worker.DLQStream(rw.prefix))
	if err != nil {
		t.Fatal(err)
	}
	left := 0
	for seq := uint64(1); ; seq++ {
		m, err := dl.GetMsg(ctx, seq)
		if err != nil {
			if seq > 64 {
				break
			}
			continue
		}
		if !worker.IsRecordSubject(rw.prefix, m.Subject) {
			left++
		}
	}
	if left != 0 {
		t.Errorf("%d dead letters left after both replays", left)
	}
	st, err := p.Status(ctx, doomed)
	if err != nil || st.State != worker.JobReplayed {
		t.Errorf("the dead-lettered job reads %+v, %v; want replayed", st, err)
	}
}
