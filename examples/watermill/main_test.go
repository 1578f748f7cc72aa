package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
	"github.com/leasehold/leasehold/worker/wmstamp"
	"github.com/leasehold/leasehold/worker/workertest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// The example runs to the end on a given server, twice, then on its own
// embedded one; each time the middleware dropped worker-a's message as
// stale and the handler shipped each order once, o-2 from worker-b.
func TestStaleMessageDropped(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Listen())
	for _, url := range []string{srv.URL(), srv.URL(), ""} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var out bytes.Buffer
		drop, err := run(ctx, &out, url)
		if err != nil {
			t.Fatalf("run: %v\n%s", err, out.String())
		}
		t.Log("\n" + out.String())
		var stale *leasehold.StaleEpochError
		if drop.Outcome != sink.Stale || !errors.As(drop.Err, &stale) || drop.Stamp.Worker != "worker-a" || stale.Max <= stale.Epoch {
			t.Errorf("drop %+v (%v): want worker-a's message refused below a higher epoch", drop.Stamp, drop.Err)
		}
		if n := strings.Count(out.String(), "downstream shipped"); n != 3 {
			t.Errorf("the handler ran %d times, want 3", n)
		}
		for _, want := range []string{"shipped o-1 from worker-a", "shipped o-2 from worker-b", "shipped o-3 from worker-b"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("the output lacks %q", want)
			}
		}
	}
}

// A handler tested without NATS: the program's ship handler publishes
// through the stamping Watermill publisher, which takes its stamp from the
// job in the handler's context; in memory the message carries the lease
// the test set and the job's first idempotency key.
func TestShipHandlerWithoutNATS(t *testing.T) {
	var sent []*message.Message
	network := publishFunc(func(topic string, msgs ...*message.Message) error {
		sent = append(sent, msgs...)
		return nil
	})
	pub := wmstamp.NewPublisher(network, wmstamp.Config{})
	mux := worker.NewMux()
	worker.Handle(mux, "ship", func(ctx context.Context, _ *worker.Job, o Order) error {
		payload, _ := json.Marshal(o)
		return pub.Publish("shipments", message.NewMessageWithContext(ctx, watermill.NewUUID(), payload))
	})
	h := workertest.New(t, workertest.Config{Handler: mux, Worker: worker.Config{Prefix: "shipping", Partitions: 1},
		Lease: leasehold.Lease{Epoch: 9, Acquisition: "a9", Holder: "worker-b"}})
	res := workertest.Work(t.Context(), h, "ship", Order{ID: "o-2"})
	res.RequireDone()
	if len(sent) != 1 || string(sent[0].Payload) != `{"ID":"o-2"}` {
		t.Fatalf("shipped %d messages", len(sent))
	}
	st, err := leasehold.StampFromMetadata(sent[0].Metadata)
	if err != nil {
		t.Fatal(err)
	}
	if want := h.Lease(0).Stamp(res.Key(0)); st != want {
		t.Errorf("stamped %+v, want %+v", st, want)
	}
}
