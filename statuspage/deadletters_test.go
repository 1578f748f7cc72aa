package statuspage

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// A worker's dead-letter stream also holds records of replays, purges and
// removed ranges: the page neither counts nor lists them as dead letters.
func TestRecordsAreNoDeadLetters(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js := natstest.Start(t).JetStream(t)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "shop", Partitions: 2}); err != nil {
		t.Fatal(err)
	}
	publish := func(subject, id string) {
		msg := nats.NewMsg(subject)
		msg.Header.Set(worker.HeaderJobID, id)
		msg.Data = []byte("{}")
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	publish("shop.dlq.0", "job-a")
	publish(worker.RecordSubject("shop", 0), "")
	publish("shop.dlq.1", "job-b")
	publish(worker.RecordSubject("shop", 1), "")
	s := &Server{cfg: Config{JetStream: js}}
	got := s.deadLetters(ctx, DeadLetterStream{Stream: worker.DLQStream("shop"), Details: true})
	if got.Error != "" || got.Count != 2 || len(got.Recent) != 2 {
		t.Fatalf("the page shows %d dead letters (%d listed, error %q), want the 2 that are not records: %+v", got.Count, len(got.Recent), got.Error, got.Recent)
	}
	for _, dl := range got.Recent {
		if dl.ID != "job-a" && dl.ID != "job-b" {
			t.Errorf("listed %+v, which is a record", dl)
		}
	}
}

// A dead letter whose stamp is in the compact form (what workers write by
// default) is listed with its partition and key, as one in the per-field
// form is.
func TestDeadLetterStampInEitherForm(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js := natstest.Start(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "sinkdlq", Subjects: []string{"sinkdlq.>"}}); err != nil {
		t.Fatal(err)
	}
	st := leasehold.Stamp{Scope: "shop", Partition: 3, Epoch: 7, Acquisition: "a1", Key: "shop.3.9.0"}
	for _, form := range []leasehold.StampFormat{leasehold.StampCompact, leasehold.StampLegacy} {
		msg := nats.NewMsg("sinkdlq.x")
		st.SetHeaderAs(msg.Header, form)
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	s := &Server{cfg: Config{JetStream: js}}
	got := s.deadLetters(ctx, DeadLetterStream{Stream: "sinkdlq", Details: true})
	if got.Error != "" || len(got.Recent) != 2 {
		t.Fatalf("listed %+v (error %q), want 2 dead letters", got.Recent, got.Error)
	}
	for _, dl := range got.Recent {
		if dl.Partition != "3" || dl.ID != "shop.3.9.0" {
			t.Errorf("listed %+v, want partition 3 and key shop.3.9.0", dl)
		}
	}
}
