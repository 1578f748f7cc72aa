package natstest_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestServerRestartKeepsStore(t *testing.T) {
	for _, name := range []string{"in-process", "listen"} {
		t.Run(name, func(t *testing.T) {
			var opts []natstest.Option
			if name == "listen" {
				opts = append(opts, natstest.Listen(), natstest.SyncAlways())
			}
			s := natstest.Start(t, opts...)
			ctx := context.Background()
			js := s.JetStream(t)
			kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b", Storage: jetstream.FileStorage})
			if err != nil {
				t.Fatal(err)
			}
			rev, err := kv.PutString(ctx, "k", "v")
			if err != nil {
				t.Fatal(err)
			}
			s.Restart(t)
			js = s.JetStream(t)
			kv, err = js.KeyValue(ctx, "b")
			if err != nil {
				t.Fatal(err)
			}
			e, err := kv.Get(ctx, "k")
			if err != nil || e.Revision() != rev || string(e.Value()) != "v" {
				t.Fatalf("after restart: %v, %v", e, err)
			}
		})
	}
}

func TestClusterKillAndRestartLeader(t *testing.T) {
	c := natstest.StartCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js := c.JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Replicas: 3}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.1", []byte("a")); err != nil {
		t.Fatal(err)
	}
	leader := c.StreamLeader(t, "S", 10*time.Second)
	c.Kill(leader)
	next := c.StreamLeader(t, "S", 10*time.Second)
	if next == leader {
		t.Fatalf("leader %d still leads after being killed", leader)
	}
	var ack *jetstream.PubAck
	var err error
	for ctx.Err() == nil {
		if ack, err = js.Publish(ctx, "s.1", []byte("b")); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil || ack.Sequence != 2 {
		t.Fatalf("publish after fail-over: %+v, %v", ack, err)
	}
	c.Restart(t, leader)
	c.WaitStreamCurrent(t, "S", 20*time.Second)
}
