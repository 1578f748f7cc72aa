package statuspage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/natstest"
)

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// withEvents starts a server with the events stream of prefix "leasehold"
// provisioned, and returns it, the stream and a context that ends after a
// minute or with the test.
func withEvents(t *testing.T) (jetstream.JetStream, jetstream.Stream, context.Context) {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	stream, err := ProvisionEvents(ctx, js, "leasehold", 1)
	if err != nil {
		t.Fatal(err)
	}
	return js, stream, ctx
}

// refuseAZombie applies through mem a write at epoch 20 on partition p of
// scope, then a zombie's at epoch 10, which must be refused as stale.
func refuseAZombie(t *testing.T, ctx context.Context, mem *sink.Memory, scope string, p leasehold.Partition) {
	t.Helper()
	stamp := func(e leasehold.Epoch, w string) leasehold.Stamp {
		return leasehold.Stamp{Scope: scope, Partition: p, Epoch: e, Acquisition: fmt.Sprint("a", e), Key: fmt.Sprint("k", e), Worker: w}
	}
	if err := mem.Apply(ctx, sink.Effect{Subject: "x", Stamp: stamp(20, "w2"), Data: []byte("new")}); err != nil {
		t.Fatal(err)
	}
	if err := mem.Apply(ctx, sink.Effect{Subject: "x", Stamp: stamp(10, "zombie"), Data: []byte("old")}); !errors.Is(err, leasehold.ErrStaleEpoch) {
		t.Fatalf("the zombie's write: %v, want refused", err)
	}
}

// waitState reads the page's status.json at url until done accepts the
// state, and returns it; what names the awaited state if ctx ends first.
func waitState(t *testing.T, ctx context.Context, url, what string, done func(State) bool) State {
	t.Helper()
	for {
		_, body := get(t, url+"status.json")
		var st State
		if err := json.Unmarshal([]byte(body), &st); err != nil {
			t.Fatal(err)
		}
		if done(st) {
			return st
		}
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			t.Fatalf("%s never reached the page: %s", what, body)
		}
	}
}
