package statuspage

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

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
