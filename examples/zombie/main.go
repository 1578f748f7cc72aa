// Command zombie walks through epoch fencing one step at a time: worker A
// takes partition 0 and writes; A pauses past its lease; B takes the
// partition over at a higher epoch and writes; A wakes up and writes with its
// old epoch, and the fenced sink refuses it, as the lease bucket refuses A's
// progress commit.
//
//	go run ./examples/zombie                       # an embedded NATS server
//	go run ./examples/zombie -nats nats://127.0.0.1:4222
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"strconv"
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
	part    = leasehold.Partition(0)
	account = "accounts.alice" // the key both workers write
	ttl     = time.Second      // how long A's pause must last before B may take over
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

// party is one worker: its view of the lease bucket and its own sink handle.
type party struct {
	name  string
	coord *coordinator.Coordinator
	sink  *kvsink.Sink
}

func run(ctx context.Context, out io.Writer, url string) error {
	say := func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }
	opts := []nats.Option{}
	if url == "" {
		dir, err := os.MkdirTemp("", "zombie")
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
	for _, b := range []string{"zombie-leases", coordinator.FenceBucketName("zombie-leases"), "zombie-effects"} {
		if err := js.DeleteKeyValue(ctx, b); err != nil && !errors.Is(err, jetstream.ErrBucketNotFound) {
			return err
		}
	}
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "zombie-leases"})
	if err != nil {
		return err
	}
	newParty := func(name string) (*party, error) {
		c, err := coordinator.New(bucket, coordinator.Config{Worker: name, TTL: ttl})
		if err != nil {
			return nil, err
		}
		s, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "zombie-effects"})
		return &party{name, c, s}, err
	}
	a, err := newParty("worker-a")
	if err != nil {
		return err
	}
	b, err := newParty("worker-b")
	if err != nil {
		return err
	}
	write := func(p *party, l leasehold.Lease, job uint64, balance int) error {
		st := l.Stamp(leasehold.EffectKey(l.Scope, part, job, 0))
		say("   %s: %s = %d, stamped epoch %d", p.name, account, balance, st.Epoch)
		return p.sink.Apply(ctx, sink.Effect{Stamp: st, Subject: account, Data: []byte(strconv.Itoa(balance))})
	}

	say("1. worker-a acquires partition 0 (renewing only when asked: it is about to freeze)")
	leaseA, err := a.coord.Acquire(ctx, part, coordinator.ManualRenew())
	if err != nil {
		return err
	}
	e1 := leaseA.Epoch()
	say("   worker-a holds partition 0 at epoch e1 = %d, its fencing token.", e1)
	if err := a.sink.Advance(ctx, leaseA.Info()); err != nil {
		return err
	}

	say("2. worker-a handles job 1 and commits its progress")
	if err := write(a, leaseA.Info(), 1, 100); err != nil {
		return err
	}
	if err := leaseA.Commit(ctx, 1); err != nil {
		return err
	}

	say("3. worker-a starts job 2 and freezes (a GC pause, a SIGSTOP): no renewals, no checks")
	say("4. worker-b wants partition 0 and retries until the server expires worker-a's lease (TTL %v)", ttl)
	var leaseB *coordinator.Lease
	for leaseB == nil {
		if leaseB, err = b.coord.Acquire(ctx, part); errors.Is(err, coordinator.ErrHeld) {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		} else if err != nil {
			return err
		}
	}
	e2 := leaseB.Epoch()
	say("   worker-b holds partition 0 at epoch e2 = %d > e1, resuming after job %d.", e2, leaseB.Progress())
	if err := b.sink.Advance(ctx, leaseB.Info()); err != nil { // the sink now refuses epochs below e2
		return err
	}

	say("5. worker-b handles jobs 2 and 3 and commits")
	if err := write(b, leaseB.Info(), 2, 70); err != nil {
		return err
	}
	if err := write(b, leaseB.Info(), 3, 120); err != nil {
		return err
	}
	if err := leaseB.Commit(ctx, 3); err != nil {
		return err
	}

	say("6. worker-a wakes up mid-job 2 and writes the balance it computed before freezing")
	werr := write(a, leaseA.Info(), 2, 70)
	if !errors.Is(werr, leasehold.ErrStaleEpoch) {
		return fmt.Errorf("the zombie's write: got %v, want leasehold.ErrStaleEpoch", werr)
	}
	say("   refused: %v", werr)
	say("   (accepted, it would have set alice back from 120 to 70 and lost job 3's deposit)")

	say("7. worker-a tries to commit job 2")
	cerr := leaseA.Commit(ctx, 2)
	if !errors.Is(cerr, leasehold.ErrLeaseLost) {
		return fmt.Errorf("the zombie's commit: got %v, want leasehold.ErrLeaseLost", cerr)
	}
	say("   refused: %v", cerr)

	e, _, err := b.sink.Get(ctx, account)
	if err != nil {
		return err
	}
	say("8. the sink holds %s = %s, written by %s under epoch %d", account, e.Data, e.Stamp.Worker, e.Stamp.Epoch)
	return leaseB.Release(ctx)
}
