// Command webhook: a job sends a webhook through a fenced HTTP relay, and
// the receiver, behind httpsink.Verifier, charges each order once.
// relay-a takes the relay lock and freezes with the request on its way;
// relay-b takes the lock over at a higher epoch and delivers it; relay-a
// wakes up, its late request reaches the receiver, and the verifier refuses
// it with 409, naming the epoch that superseded it.
//
//	go run ./examples/webhook                       # an embedded NATS server
//	go run ./examples/webhook -nats nats://127.0.0.1:4222
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/worker"
)

type Order struct{ ID string }

func main() {
	url := flag.String("nats", os.Getenv("NATS_URL"), "NATS server `URL` (empty: an embedded server)")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, _, err := run(ctx, os.Stdout, *url); err != nil {
		log.Fatal(err)
	}
}

// run plays the example. It returns the verifier's refusal of relay-a's
// late request and how often the receiver charged each order.
func run(ctx context.Context, out io.Writer, url string) (httpsink.Refusal, map[string]int, error) {
	say := log.New(out, "", 0).Printf // one line at a time, from the receiver's handler too
	var none httpsink.Refusal
	opts := []nats.Option{}
	if url == "" {
		dir, err := os.MkdirTemp("", "webhook")
		if err != nil {
			return none, nil, err
		}
		defer os.RemoveAll(dir)
		srv, err := server.NewServer(&server.Options{JetStream: true, StoreDir: dir, DontListen: true, NoSigs: true})
		if err != nil {
			return none, nil, err
		}
		srv.Start()
		defer srv.Shutdown()
		opts = append(opts, nats.InProcessServer(srv))
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return none, nil, err
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	prefix := fmt.Sprintf("hooks%d", time.Now().UnixNano()) // a fresh job stream per run
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: prefix, Partitions: 1}); err != nil {
		return none, nil, err
	}
	leases, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: prefix + "-leases"})
	if err != nil {
		return none, nil, err
	}

	// The receiver you own: the verifier refuses stale relays and runs the
	// handler once per Idempotency-Key.
	var mu sync.Mutex
	charges, charged := map[string]int{}, make(chan struct{}, 1)
	v, err := httpsink.NewVerifier(httpsink.VerifierConfig{RequireRelay: true})
	if err != nil {
		return none, nil, err
	}
	recv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: v.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var o Order
		_ = json.NewDecoder(r.Body).Decode(&o)
		relay, _ := httpsink.RelayFrom(r.Context())
		mu.Lock()
		charges[o.ID]++
		mu.Unlock()
		select {
		case charged <- struct{}{}:
		default:
		}
		say("receiver: charged %s, sent by %s at relay epoch %d", o.ID, relay.Holder, relay.Epoch)
	}))}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return none, nil, err
	}
	go func() { _ = recv.Serve(ln) }()
	defer recv.Close()

	// The job: its webhook is an effect in the effect log, stamped with the
	// partition's epoch.
	w, err := worker.New(worker.Config{JetStream: js, Prefix: prefix, Partitions: 1, Bucket: leases,
		Coordinator: coordinator.Config{Worker: "worker-1"},
		Handler: worker.JSON(func(ctx context.Context, job *worker.Job, o Order) error {
			body, _ := json.Marshal(o)
			return job.Emit(ctx, body)
		})})
	if err != nil {
		return none, nil, err
	}
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: 1, Bucket: leases})
	if err != nil {
		return none, nil, err
	}
	wctx, stopWorker := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(wctx) }()
	job, err := worker.Enqueue(ctx, p, "order", Order{ID: "o-1"})
	if err == nil {
		_, err = p.Wait(ctx, job)
	}
	stopWorker()
	if werr := <-stopped; err == nil {
		err = werr
	}
	if err != nil {
		return none, nil, err
	}
	say("worker-1: job o-1 done; its webhook waits in the effect log")

	// Two relays of one lock. relay-a's transport freezes its request, as a
	// paused process would, until wake; its lock then renews no more.
	held, wake := make(chan struct{}), make(chan struct{})
	var once sync.Once
	frozen := roundTrip(func(r *http.Request) (*http.Response, error) {
		once.Do(func() { close(held) })
		<-wake
		return http.DefaultTransport.RoundTrip(r.WithContext(context.WithoutCancel(r.Context())))
	})
	type answer struct {
		status int
		body   []byte
	}
	late := make(chan answer, 1)
	relay := func(name string, tr http.RoundTripper, manual bool) (*httpsink.Relay, func(), error) {
		c, err := coordinator.New(leases, coordinator.Config{Worker: name, TTL: time.Second})
		if err != nil {
			return nil, nil, err
		}
		cfg := httpsink.Config{URL: "http://" + ln.Addr().String() + "/orders", Coordinator: c, Lock: "hooks", Name: name, Transport: tr}
		if manual {
			cfg.LockOptions = []coordinator.AcquireOption{coordinator.ManualRenew()}
		}
		r, err := httpsink.New(cfg)
		if err != nil {
			return nil, nil, err
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			// AckWait: how soon the log hands a frozen relay's effects to the next.
			_ = r.RunSink(rctx, js, streamsink.Config{Prefix: prefix, Consumer: prefix + "-hooks", Name: name, Verifier: leases, AckWait: time.Second})
		}()
		return r, func() { cancel(); <-done }, nil
	}
	a, stopA, err := relay("relay-a", roundTrip(func(r *http.Request) (*http.Response, error) {
		resp, err := frozen.RoundTrip(r)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body = io.NopCloser(bytes.NewReader(body))
			select {
			case late <- answer{resp.StatusCode, body}:
			default:
			}
		}
		return resp, err
	}), true)
	if err != nil {
		return none, nil, err
	}
	defer stopA()
	renewed := make(chan struct{})
	go func() { // relay-a renews its lock until it freezes
		defer close(renewed)
		for {
			select {
			case <-held:
				return
			case <-ctx.Done():
				return
			case <-time.After(200 * time.Millisecond):
				if l := a.Lease(); l != nil {
					_ = l.Renew(ctx)
				}
			}
		}
	}()
	select {
	case <-held:
	case <-ctx.Done():
		return none, nil, ctx.Err()
	}
	<-renewed
	if l := a.Lease(); l != nil {
		say("relay-a: holds lock hooks at epoch %d, sends o-1's webhook... and freezes", l.Epoch())
	}
	_, stopB, err := relay("relay-b", http.DefaultTransport, false)
	if err != nil {
		return none, nil, err
	}
	defer stopB()
	select { // relay-b takes the lock over once relay-a's expires, and delivers
	case <-charged:
	case <-ctx.Done():
		return none, nil, ctx.Err()
	}
	close(wake)
	var ans answer
	select {
	case ans = <-late:
	case <-ctx.Done():
		return none, nil, ctx.Err()
	}
	var ref httpsink.Refusal
	_ = json.Unmarshal(ans.body, &ref)
	say("relay-a: wakes up; its late request gets %d: %s", ans.status, ref.Message)
	mu.Lock()
	defer mu.Unlock()
	say("receiver: o-1 charged %d time(s)", charges["o-1"])
	return ref, map[string]int{"o-1": charges["o-1"]}, nil
}

type roundTrip func(*http.Request) (*http.Response, error)

func (f roundTrip) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
