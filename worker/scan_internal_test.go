package worker

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/testing/natstest"
)

// behindCopy stands for a stream whose one-replica scan consumer the
// server placed on a follower behind the leader: reads through the leader
// go to one server, and the consumer is made on a second one holding the
// same stream with fewer of its messages. A real cluster places the
// consumer on a random peer, which no test can choose.
type behindCopy struct {
	jetstream.JetStream                     // the leader's
	copy                jetstream.JetStream // the follower's
}

func (b behindCopy) CreateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return b.copy.CreateConsumer(ctx, stream, cfg)
}

func (b behindCopy) DeleteConsumer(ctx context.Context, stream, name string) error {
	return b.copy.DeleteConsumer(ctx, stream, name)
}

// A scan served by a copy that lacks the leader's last message (a dead
// letter stored a moment ago) fails, saying so, rather than report what
// the copy holds as all there is; a copy that holds it is read in full.
func TestScanOfACopyBehindTheLeader(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b := behindCopy{natstest.Start(t).JetStream(t), natstest.Start(t).JetStream(t)}
	for _, js := range []jetstream.JetStream{b.JetStream, b.copy} {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}}); err != nil {
			t.Fatal(err)
		}
		if _, err := js.Publish(ctx, "dlq.0", []byte("first")); err != nil {
			t.Fatal(err)
		}
	}
	read := func(js jetstream.JetStream) (int, error) {
		n := 0
		err := scan(ctx, js, "DLQ", "dlq.0", jetstream.ConsumerConfig{}, func(jetstream.Msg, *jetstream.MsgMetadata) bool { n++; return true })
		return n, err
	}
	if n, err := read(b); err != nil || n != 1 {
		t.Fatalf("a copy as far as the leader: read %d, %v; want 1", n, err)
	}
	if _, err := b.JetStream.Publish(ctx, "dlq.0", []byte("second")); err != nil {
		t.Fatal(err)
	}
	if _, err := read(b); err == nil || !strings.Contains(err.Error(), "stayed behind its leader") {
		t.Fatalf("a copy behind the leader: %v, want an error that says so", err)
	}
}
