package worker

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A runner that starts takes its partition's cancels from the worker's
// watch only once the watch has delivered every record stored before the
// runner asked: a cancel the watch still carries is not missed. While
// the watch is held back, a try ends with errFeedBehind (the runner then
// reads the bucket itself), never with the cancel left out. A purge of
// the bucket's stream, which no watch sees, drops what the watch kept.
func TestCancelFeedCatchesUpBeforeHandingRecords(t *testing.T) {
	const p = leasehold.Partition(2)
	js := natstest.Start(t).JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := provisionCancels(ctx, js, "jobs", 1); err != nil {
		t.Fatal(err)
	}
	w := &Worker{cfg: Config{JetStream: js, Prefix: "jobs"}}
	f := newCancelFeed(w)
	defer f.close()
	held := make(chan struct{})
	gate := make(chan struct{})
	var release sync.Once
	open := func() { release.Do(func() { close(gate) }) }
	defer open() // before close, which waits for the watch's goroutine
	var first sync.Once
	f.delivered = func(jetstream.KeyValueEntry) {
		// The bucket is empty: the first change is the test's record,
		// held back until the test lets it go.
		first.Do(func() {
			select {
			case held <- struct{}{}:
				<-gate
			case <-gate:
			}
		})
	}
	kv, err := f.ensure(ctx, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}

	stored := time.Unix(1700000000, 0).UTC()
	job := &Job{Partition: p, Seq: 9, Enqueued: stored, Header: nats.Header{}}
	rec, err := json.Marshal(cancelRecord{Ref: "r", Partition: uint32(p), Seq: 9, Stored: stored})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, cancelSeqKey(p, 9), rec); err != nil {
		t.Fatal(err)
	}
	<-held // the watch has the record, and does not count it yet

	newRunnerCancels := func() *cancels {
		r := &runner{w: w, p: p, log: slog.New(slog.DiscardHandler)}
		return newCancels(r, kv, f)
	}
	// A try bounds both the question for the last sequence and the wait
	// for the watch: it is the worker's first (apiTry(0), 2 s), long
	// enough for a busy server's answer, so that a try that fails here
	// fails for the watch, not for a question left unanswered.
	try := apiTry(0)
	behind := newRunnerCancels()
	if err := f.caughtUp(ctx, kv, p, behind, try); !errors.Is(err, errFeedBehind) {
		t.Fatalf("with the record held back, caughtUp returned %v, want errFeedBehind", err)
	}
	if behind.has(job) {
		t.Fatal("a try that failed handed records over")
	}
	open()
	c := newRunnerCancels()
	if err := f.caughtUp(ctx, kv, p, c, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if !c.has(job) {
		t.Fatal("the cancel stored before the runner started is not in what the watch handed it")
	}
	f.leave(p, c)

	// Purged as a stream, not as a key: no change comes, and the record
	// the watch kept is not handed to a runner that starts afterwards.
	stream, err := js.Stream(ctx, "KV_"+CancelBucket("jobs"))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	after := newRunnerCancels()
	if err := f.caughtUp(ctx, kv, p, after, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if after.has(job) {
		t.Fatal("a record purged with the stream was handed to a runner that started after the purge")
	}

	// The stream's last message removed by an operator: no watch
	// delivers it, and a try ends errFeedBehind (the runner reads the
	// bucket itself). The runners after it with the same answer do not
	// wait a try each.
	for i := range 2 {
		if _, err := kv.Put(ctx, cancelSeqKey(p, uint64(20+i)), rec); err != nil {
			t.Fatal(err)
		}
	}
	// A KV stream denies deleting a message; a purge of one subject
	// removes it as well, and writes no marker.
	if err := stream.Purge(ctx, jetstream.WithPurgeSubject("$KV."+CancelBucket("jobs")+"."+cancelSeqKey(p, 21))); err != nil {
		t.Fatal(err)
	}
	// A watch that starts now never sees it (this one had; it keeps the
	// record, as a runner that read it before the purge would have).
	f2 := newCancelFeed(w)
	defer f2.close()
	if _, err := f2.ensure(ctx, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	f = f2
	if err := f.caughtUp(ctx, kv, p, newRunnerCancels(), try); !errors.Is(err, errFeedBehind) {
		t.Fatalf("with the stream's last message removed, caughtUp returned %v, want errFeedBehind", err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	if err := f.caughtUp(wctx, kv, p, newRunnerCancels(), time.Hour); !errors.Is(err, errFeedBehind) {
		t.Fatalf("a second runner asking after a try found the watch stuck: %v, want errFeedBehind at once", err)
	}
}
