package statuspage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/headless"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// receiver is an HTTP receiver that takes every request, and can be
// stopped and started again on its address.
type receiver struct {
	addr string
	got  chan string // the Idempotency-Key of each request taken
	srv  *http.Server
	done chan struct{}
}

func startReceiver(t *testing.T, addr string, got chan string) *receiver {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	rc := &receiver{addr: ln.Addr().String(), got: got, done: make(chan struct{})}
	rc.srv = &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case got <- r.Header.Get("Idempotency-Key"):
		default:
		}
	})}
	go func() { defer close(rc.done); _ = rc.srv.Serve(ln) }()
	t.Cleanup(rc.stop)
	return rc
}

// stop closes the receiver's listener and connections: the relay's next
// request finds nobody.
func (rc *receiver) stop() {
	_ = rc.srv.Close()
	<-rc.done
}

// An HTTP receiver that is down shows on the status page, in a real
// headless Chromium: a relay delivers to a test receiver; the receiver is
// stopped and the relay's next request fails; the page shows the
// endpoint down, since when and the last error, pushed by server-sent
// events; the receiver comes back and the page shows the endpoint up.
func TestDestinationDownInChromium(t *testing.T) {
	t.Parallel()
	headless.Path(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	js := natstest.Start(t).JetStream(t)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "shop", Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "shop-leases", Scope: "shop"})
	if err != nil {
		t.Fatal(err)
	}
	page, err := Serve(ctx, ServeConfig{JetStream: js, Bucket: b, Prefix: "shop", Name: "relay-process", Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer page.Close()

	got := make(chan string, 16)
	rc := startReceiver(t, "127.0.0.1:0", got)
	coord, err := coordinator.New(b, coordinator.Config{Worker: "relay-1", TTL: 2 * time.Second, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := httpsink.New(httpsink.Config{URL: "http://" + rc.addr + "/orders", Coordinator: coord, Name: "orders-api",
		OnEndpoint: page.EndpointObserver(), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() {
		relayDone <- relay.RunSink(rctx, js, streamsink.Config{Prefix: "shop", Provision: true, Consumer: "shop-relay", Name: "relay",
			MaxDeliveries: 1000, MaxBackoff: 50 * time.Millisecond, AckWait: time.Second, FetchWait: 100 * time.Millisecond,
			Logger: slog.New(slog.DiscardHandler)})
	}()
	defer func() {
		stopRelay()
		if err := <-relayDone; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("the relay: %v", err)
		}
	}()
	stamp := func(key string) leasehold.Stamp {
		return leasehold.Stamp{Scope: "shop", Partition: 0, Epoch: 1, Acquisition: "a1", Key: key, Worker: "w1"}
	}
	publish := func(key string) {
		t.Helper()
		h := nats.Header{}
		stamp(key).SetHeader(h)
		if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: "shop.out.orders", Header: h, Data: []byte(`{"order":"` + key + `"}`)}); err != nil {
			t.Fatal(err)
		}
	}
	waitGot := func(key string) {
		t.Helper()
		for {
			select {
			case k := <-got:
				if k == httpsink.IdempotencyKey(stamp(key)) {
					return
				}
			case err := <-relayDone:
				relayDone <- err
				t.Fatalf("the relay stopped before the receiver got %s: %v", key, err)
			case <-ctx.Done():
				t.Fatalf("the receiver never got %s (relay ready: %v)", key, relay.Ready(context.Background()))
			}
		}
	}
	// The barrier a worker publishes when it acquires partition 0 at
	// epoch 1, then its effect.
	bh := nats.Header{}
	leasehold.Stamp{Scope: "shop", Partition: 0, Epoch: 1, Acquisition: "a1", Key: leasehold.BarrierKey("shop", 0, 1), Worker: "w1"}.SetHeader(bh)
	bh.Set(leasehold.HeaderBarrier, "1")
	if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: "shop.out.barrier", Header: bh}); err != nil {
		t.Fatal(err)
	}
	publish("k1")
	waitGot("k1")

	browser := headless.Start(t, ctx, page.URL())
	browser.WaitFor(t, ctx, "the first state", `Number(document.body.dataset.updates) >= 1`)
	var hidden bool
	if err := browser.Eval(ctx, `document.getElementById("destinations-section").hidden`, &hidden); err != nil || !hidden {
		t.Fatalf("a Destinations panel while every receiver answers (hidden %v, %v)", hidden, err)
	}

	rc.stop()
	stopped := time.Now()
	publish("k2")
	browser.WaitFor(t, ctx, "the endpoint down, since when, and why", fmt.Sprintf(`!document.getElementById("destinations-section").hidden &&
		Array.from(document.querySelectorAll("#destinations tr.down")).some(tr => { const c = tr.cells;
			return c[0].textContent === "orders-api" && c[1].textContent === "default" && c[2].textContent === %q && c[3].textContent === "down" &&
				c[4].textContent !== "-" && c[5].textContent.includes("connection refused") && c[6].textContent === "relay-process" })`, "http://"+rc.addr))
	var st State
	code, body := get(t, page.URL()+"status.json")
	if err := json.Unmarshal([]byte(body), &st); err != nil || code != 200 || len(st.Destinations) != 1 || !st.Destinations[0].Down || st.Destinations[0].Since.Before(stopped.Add(-time.Second)) {
		t.Fatalf("status.json: %d %+v (%v)", code, st.Destinations, err)
	}

	startReceiver(t, rc.addr, got) // back on its address
	waitGot("k2")
	browser.WaitFor(t, ctx, "the endpoint up again", `Array.from(document.querySelectorAll("#destinations tr.up")).some(tr =>
		tr.cells[0].textContent === "orders-api" && tr.cells[3].textContent === "up" && tr.cells[5].textContent === "-")`)
}
