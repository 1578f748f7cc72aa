// Command singleton runs a nightly report as a singleton job: whoever holds
// the lock "nightly-report" computes the report and writes it through a KV
// sink, stamped with the lock's scope and epoch. host-a takes the lock;
// host-b, running the same job, is refused it. host-a freezes past its
// lease; host-b's RunSingleton takes the lock over at a higher epoch and
// fences the sink; host-a wakes up and writes its report late, and the sink
// refuses it.
//
//	go run ./examples/singleton                       # an embedded NATS server
//	go run ./examples/singleton -nats nats://127.0.0.1:4222
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
)

const (
	lock   = "nightly-report"    // the singleton's lock: one holder at a time
	report = "report.2026-01-02" // the key the report is written under
	ttl    = time.Second         // how long host-a's freeze must last before host-b may take over
)

func main() {
	url := flag.String("nats", os.Getenv("NATS_URL"), "NATS server `URL` (empty: an embedded server)")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout, *url); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, out io.Writer, url string) error {
	say := func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }
	opts := []nats.Option{}
	if url == "" {
		dir, err := os.MkdirTemp("", "singleton")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		srv, err := server.NewServer(&server.Options{JetStream: true, StoreDir: dir, DontListen: true, NoSigs: true})
		if err != nil {
			return err
		}
		srv.Start()
		defer srv.Shutdown()
		opts = append(opts, nats.InProcessServer(srv))
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	// A clean start: drop what an earlier run left (fence records included).
	for _, b := range []string{"reports-leases", coordinator.FenceBucketName("reports-leases"), "reports"} {
		if err := js.DeleteKeyValue(ctx, b); err != nil && !errors.Is(err, jetstream.ErrBucketNotFound) {
			return err
		}
	}
	// The lease bucket issues the lock's epochs; its scope ("reports")
	// names the locks' namespace.
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "reports-leases"})
	if err != nil {
		return err
	}
	// The sink keeps one fence per scope, so the lock's epochs order the
	// report's writers and nothing else. With the bucket as its verifier
	// it also refuses epochs the bucket never issued.
	reports, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "reports", Verifier: bucket})
	if err != nil {
		return err
	}
	hostA, err := coordinator.New(bucket, coordinator.Config{Worker: "host-a", TTL: ttl})
	if err != nil {
		return err
	}
	hostB, err := coordinator.New(bucket, coordinator.Config{Worker: "host-b", TTL: ttl})
	if err != nil {
		return err
	}
	say("1. host-a takes the lock %q (renewing only when asked: it is about to freeze)", lock)
	la, err := hostA.TryLock(ctx, lock, coordinator.ManualRenew())
	if err != nil {
		return err
	}
	a := la.Info()
	say("   host-a holds it: scope %q, partition %d, epoch e1 = %d", a.Scope, a.Partition, a.Epoch)
	if err := reports.Advance(ctx, a); err != nil { // the sink now refuses epochs below e1
		return err
	}

	say("2. host-b starts the same job: TryLock is refused while host-a holds the lock")
	_, err = hostB.TryLock(ctx, lock)
	if !errors.Is(err, coordinator.ErrHeld) {
		return fmt.Errorf("host-b's TryLock: got %v, want coordinator.ErrHeld", err)
	}
	say("   refused: %v", err)

	say("3. host-a computes the report and freezes before writing it: no renewals, no checks")
	late := "orders=41, computed by host-a"

	say("4. host-b runs the job with RunSingleton, which waits for the lock; the server expires host-a's lease after %v", ttl)
	tookOver := make(chan leasehold.Lease, 1)
	zombieWrote := make(chan struct{})
	singleton := make(chan error, 1)
	compute := func(ctx context.Context, l leasehold.Lease) (string, error) {
		tookOver <- l
		select { // the walk-through lets host-a write first; a real job just computes
		case <-zombieWrote:
		case <-ctx.Done():
			return "", ctx.Err()
		}
		return "orders=42, computed by host-b", nil
	}
	go func() { singleton <- hostB.RunSingleton(ctx, lock, nightly(reports, compute)) }()
	var b leasehold.Lease
	select {
	case b = <-tookOver:
	case err := <-singleton:
		return fmt.Errorf("host-b's singleton ended before it took the lock: %v", err)
	case <-ctx.Done():
		return ctx.Err()
	}
	say("   host-b leads at epoch e2 = %d > e1, same scope %q, and has advanced the sink to e2", b.Epoch, b.Scope)

	say("5. host-a wakes up and writes the report it computed, stamped with e1")
	werr := reports.Apply(ctx, sink.Effect{Stamp: a.Stamp(report), Subject: report, Data: []byte(late)})
	close(zombieWrote)
	if !errors.Is(werr, leasehold.ErrStaleEpoch) {
		return fmt.Errorf("host-a's late write: got %v, want leasehold.ErrStaleEpoch", werr)
	}
	say("   refused: %v", werr)

	say("6. host-b writes its report; RunSingleton releases the lock when the job returns")
	if err := <-singleton; err != nil {
		return err
	}

	say("7. host-a tries to renew its lease")
	rerr := la.Renew(ctx)
	if !errors.Is(rerr, leasehold.ErrLeaseLost) {
		return fmt.Errorf("host-a's renewal: got %v, want leasehold.ErrLeaseLost", rerr)
	}
	say("   refused: %v", rerr)

	e, ok, err := reports.Get(ctx, report)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("the sink holds no %s", report)
	}
	say("8. the sink holds %s = %q, written by %s under epoch %d", report, e.Data, e.Stamp.Worker, e.Stamp.Epoch)
	return nil
}

// nightly is the singleton job, run while its host holds the lock: fence
// the sink at the lock's epoch, compute the report, write it stamped with
// the lock's scope, partition 0, epoch and acquisition.
func nightly(reports *kvsink.Sink, compute func(context.Context, leasehold.Lease) (string, error)) func(context.Context, *coordinator.Lease) error {
	return func(ctx context.Context, l *coordinator.Lease) error {
		// Fence from the moment of take-over: from here on the sink
		// refuses the previous holder, whether or not this run has
		// written yet.
		if err := reports.Advance(ctx, l.Info()); err != nil {
			return err
		}
		text, err := compute(ctx, l.Info()) // ctx ends when the lease is lost
		if err != nil {
			return err
		}
		return reports.Apply(ctx, sink.Effect{Stamp: l.Info().Stamp(report), Subject: report, Data: []byte(text)})
	}
}
