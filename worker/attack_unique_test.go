package worker_test

import (
	"errors"
	"testing"
	"time"

	"github.com/leasehold/leasehold/worker"
)

// Every entry a producer writes in the bucket of unique jobs carries a
// per-key TTL, so a uniqueness ends with its period. An entry put there
// without a TTL (by any credential that may write the bucket: every
// producer's, or an operator's `nats kv put`) is not one a producer wrote.
// Whatever it holds, it is taken over once older than the producer's bound
// on a stranger's reservation: one shaped as a reservation without a job,
// and one shaped as a stored job's record (it names a sequence, here of
// no job at all), which used to hold the key for ever.
func TestAttackUniqueReservationWithoutTTLIsTakenOver(t *testing.T) {
	uniqueForgedWithoutTTL(t, `{"id":"ghost","partition":1}`)
}

func TestAttackUniqueRecordWithoutTTLHoldsForEver(t *testing.T) {
	uniqueForgedWithoutTTL(t, `{"id":"ghost","partition":1,"seq":999999}`)
}

func TestAttackUniqueGarbageWithoutTTLIsTakenOver(t *testing.T) {
	uniqueForgedWithoutTTL(t, `not a record`)
}

// uniqueForgedWithoutTTL puts forged, without a TTL, in the place of a
// uniqueness, and fails unless an enqueue of it succeeds within three
// times the producer's bound on a stranger's reservation.
func uniqueForgedWithoutTTL(t *testing.T, forged string) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, 60*time.Second)
	p, kv, name := freedUniqueness(t, ctx, e, time.Minute) // bound: 3s
	if _, err := kv.Put(ctx, name, []byte(forged)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := p.EnqueueTo(ctx, 0, []byte("x"), worker.UniqueKey("nightly", time.Minute))
		if err == nil {
			return
		}
		if !errors.Is(err, worker.ErrDuplicateJob) {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("forged entry %s without a TTL still refuses the uniqueness 10 s later (the producer's bound is 3 s, the period 1 m): %v", forged, err)
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(250 * time.Millisecond): // the bound is a time: wait it out
		}
	}
}

// A uniqueness's end is a per-key TTL the server keeps: across a server
// restart in the middle of the period, it still ends. The test restarts
// the server while a two-second uniqueness holds, then fails unless the
// same job is stored again within ten times the period (a TTL lost in the
// restart would refuse it for ever).
func TestAttackUniqueEndsAcrossRestart(t *testing.T) {
	e := newEnv(t, 2)
	ctx := ctxFor(t, 60*time.Second)
	p := e.producer(t)
	if _, err := p.EnqueueTo(ctx, 1, []byte("x"), worker.UniqueKey("report", 2*time.Second)); err != nil {
		t.Fatal(err)
	}
	e.srv.Restart(t)
	e.js = e.srv.JetStream(t) // the in-process connection did not survive
	p = e.producer(t)
	if _, err := p.EnqueueTo(ctx, 1, []byte("x"), worker.UniqueKey("report", 2*time.Second)); !errors.Is(err, worker.ErrDuplicateJob) {
		t.Fatalf("a copy within the period, after the restart: %v", err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := p.EnqueueTo(ctx, 1, []byte("x"), worker.UniqueKey("report", 2*time.Second))
		if err == nil {
			return
		}
		if !errors.Is(err, worker.ErrDuplicateJob) {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("a uniqueness of 2 s still refuses 20 s after a restart: %v", err)
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(200 * time.Millisecond): // the period is a time: wait it out
		}
	}
}
