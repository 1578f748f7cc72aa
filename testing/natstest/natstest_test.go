package natstest_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

// putInFileBucket creates the key-value bucket "b", stored in files, on s
// and puts v at "k"; it returns the revision.
func putInFileBucket(t *testing.T, ctx context.Context, s *natstest.Server, v string) uint64 {
	t.Helper()
	kv, err := s.JetStream(t).CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b", Storage: jetstream.FileStorage})
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.PutString(ctx, "k", v)
	if err != nil {
		t.Fatal(err)
	}
	return rev
}

// openBucket opens the bucket "b" on s over a new connection.
func openBucket(t *testing.T, ctx context.Context, s *natstest.Server) jetstream.KeyValue {
	t.Helper()
	kv, err := s.JetStream(t).KeyValue(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

func TestServerRestartKeepsStore(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"in-process", "listen"} {
		t.Run(name, func(t *testing.T) {
			var opts []natstest.Option
			if name == "listen" {
				opts = append(opts, natstest.Listen(), natstest.SyncAlways())
			}
			s := natstest.Start(t, opts...)
			ctx := context.Background()
			rev := putInFileBucket(t, ctx, s, "v")
			s.Restart(t)
			e, err := openBucket(t, ctx, s).Get(ctx, "k")
			if err != nil || e.Revision() != rev || string(e.Value()) != "v" {
				t.Fatalf("after restart: %v, %v", e, err)
			}
		})
	}
}

func TestClusterKillAndRestartLeader(t *testing.T) {
	t.Parallel()
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
	// One attempt per two seconds: a publish sent while the stream has no
	// leader gets no answer at all, and would otherwise wait out ctx.
	for ctx.Err() == nil {
		actx, acancel := context.WithTimeout(ctx, 2*time.Second)
		ack, err = js.Publish(actx, "s.1", []byte("b"), jetstream.WithMsgID("b"))
		acancel()
		if err == nil {
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

// A frozen proxy holds bytes both ways without closing anything: a client
// behind it times out, and recovers when it thaws.
func TestProxyFreezeAndThaw(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t, natstest.Listen())
	px := natstest.NewProxy(t, s.URL())
	nc, err := nats.Connect(px.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "P", Subjects: []string{"p"}}); err != nil {
		t.Fatal(err)
	}
	px.Freeze()
	fctx, fcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = js.Publish(fctx, "p", []byte("held"))
	fcancel()
	if err == nil {
		t.Fatal("a publish through a frozen proxy was acknowledged")
	}
	if !nc.IsConnected() {
		t.Fatal("freezing closed the connection")
	}
	px.Thaw()
	if _, err := js.Publish(ctx, "p", []byte("after")); err != nil {
		t.Fatalf("publish after thaw: %v", err)
	}
}

// A restored snapshot forgets what was written after it was taken, and the
// stream hands the same sequence out again.
func TestSnapshotRestore(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	before := putInFileBucket(t, ctx, s, "before")
	s.Shutdown()
	snap := s.Snapshot(t)
	s.Restart(t)
	lost, err := openBucket(t, ctx, s).PutString(ctx, "k", "lost")
	if err != nil {
		t.Fatal(err)
	}
	s.Shutdown()
	s.Restore(t, snap)
	s.Restart(t)
	kv := openBucket(t, ctx, s)
	if e, err := kv.Get(ctx, "k"); err != nil || string(e.Value()) != "before" || e.Revision() != before {
		t.Fatalf("after restore: %v, %v; want the value written before the snapshot", e, err)
	}
	again, err := kv.PutString(ctx, "k", "again")
	if err != nil {
		t.Fatal(err)
	}
	if again != lost {
		t.Fatalf("the write after the restore got revision %d, want %d again", again, lost)
	}
}
