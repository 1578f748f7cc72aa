package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/sink/kvsink"
)

// The HTTP destination: beside the KV sink, relays (`leasehold sink
// --kind http`, two processes sharing one lock) read the same effect log
// under their own runner and send each admitted effect to a receiver in
// the harness process. The receiver is what a service you own would run:
// an httpsink.Verifier, its fences and keys in KV buckets of the run's
// NATS, in front of a handler that records what it was given. Every
// request is recorded, with two places in one sequence: when it arrived,
// before the Verifier judged it, and when the handler ran, after. A
// handler that ran before another request arrived was admitted first, so
// the second's relay epoch had to be at least the first's.

const (
	httpFencesKV = "chaos-http-fences"
	httpKeysKV   = "chaos-http-keys"
	relayName    = "relay"
	relayLock    = "chaos-relay"
	receiverProc = "receiver" // the target named in its fault records
)

// receiver is the harness's HTTP receiver.
type receiver struct {
	log     *slog.Logger
	handler http.Handler
	addr    string
	ln      net.Listener

	seq atomic.Uint64

	mu      sync.Mutex
	srv     *http.Server // nil while refusing connections
	served  chan struct{}
	down503 bool
	hold    *heldRequest // armed by a relay pause
	records []Delivery
	handled map[string]bool // keys a handler ran for
	top     leasehold.Epoch // highest relay epoch a handler ran for
}

// heldRequest is a request the receiver keeps from the Verifier until
// the harness releases it: a request on the wire while its relay is
// paused.
type heldRequest struct {
	got     chan leasehold.Lease // the held request's relay stamp
	release chan struct{}
	once    sync.Once
}

func (hr *heldRequest) free() { hr.once.Do(func() { close(hr.release) }) }

type deliveryKey struct{}

// startReceiver starts the receiver on a loopback port. unverified leaves
// the Verifier out: every request reaches the handler.
func startReceiver(ctx context.Context, js jetstream.JetStream, bucket *coordinator.Bucket, replicas int, unverified bool, log *slog.Logger) (*receiver, error) {
	rc := &receiver{log: log, handled: map[string]bool{}}
	var h http.Handler = http.HandlerFunc(rc.handle)
	if !unverified {
		fences, err := kvsink.New(ctx, js, kvsink.Config{Bucket: httpFencesKV, Replicas: replicas, MinReplicas: replicas, Name: "http-verifier",
			Verifier: bucket, Logger: log})
		if err != nil {
			return nil, fmt.Errorf("chaos: the receiver's fences: %w", err)
		}
		keys, err := httpsink.NewKVKeys(ctx, js, httpsink.KVKeysConfig{Bucket: httpKeysKV, Replicas: replicas})
		if err != nil {
			return nil, fmt.Errorf("chaos: the receiver's keys: %w", err)
		}
		v, err := httpsink.NewVerifier(httpsink.VerifierConfig{Fences: fences, Keys: keys, RequireRelay: true,
			RelayScopes: []string{bucket.Scope() + "/" + relayLock}, HoldFor: 10 * time.Second, Logger: log})
		if err != nil {
			return nil, err
		}
		h = v.Wrap(h)
	}
	rc.handler = h
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("chaos: the receiver: %w", err)
	}
	rc.addr = ln.Addr().String()
	rc.serve(ln)
	return rc, nil
}

func (rc *receiver) url() string { return "http://" + rc.addr + "/effects" }

// serve serves on ln until stop. Called with rc.mu free.
func (rc *receiver) serve(ln net.Listener) {
	srv := &http.Server{Handler: http.HandlerFunc(rc.front), ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(rc.log.Handler(), slog.LevelDebug)}
	done := make(chan struct{})
	rc.mu.Lock()
	rc.srv, rc.served, rc.ln = srv, done, ln
	rc.mu.Unlock()
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
}

// refuse closes the listener and every connection: connections are
// refused until accept.
func (rc *receiver) refuse() {
	rc.mu.Lock()
	srv, done := rc.srv, rc.served
	rc.srv = nil
	rc.mu.Unlock()
	if srv == nil {
		return
	}
	_ = srv.Close()
	<-done
}

// accept listens again on the same address; a port taken meanwhile is
// retried for a while.
func (rc *receiver) accept(ctx context.Context) error {
	rc.mu.Lock()
	up := rc.srv != nil
	rc.mu.Unlock()
	if up {
		return nil
	}
	for i := 0; ; i++ {
		ln, err := net.Listen("tcp", rc.addr)
		if err == nil {
			rc.serve(ln)
			return nil
		}
		if i == 50 {
			return fmt.Errorf("chaos: the receiver cannot listen on %s again: %w", rc.addr, err)
		}
		if err := sleepCtx(ctx, 100*time.Millisecond); err != nil {
			return err
		}
	}
}

// set503 makes the receiver answer every request 503 (on) or serve again.
func (rc *receiver) set503(on bool) {
	rc.mu.Lock()
	rc.down503 = on
	rc.mu.Unlock()
}

// close stops serving for good and frees a held request.
func (rc *receiver) close() {
	rc.mu.Lock()
	hr := rc.hold
	rc.hold = nil
	rc.mu.Unlock()
	if hr != nil {
		hr.free()
	}
	rc.refuse()
}

// armHold makes the receiver keep the next relayed request from the
// Verifier until free is called.
func (rc *receiver) armHold() *heldRequest {
	hr := &heldRequest{got: make(chan leasehold.Lease, 1), release: make(chan struct{})}
	rc.mu.Lock()
	rc.hold = hr
	rc.mu.Unlock()
	return hr
}

// disarm takes back a hold that has caught nothing.
func (rc *receiver) disarm(hr *heldRequest) {
	rc.mu.Lock()
	if rc.hold == hr {
		rc.hold = nil
	}
	rc.mu.Unlock()
	hr.free()
}

// front records every request and hands it to the Verifier, unless the
// receiver is down or holds it.
func (rc *receiver) front(w http.ResponseWriter, r *http.Request) {
	d := &Delivery{Arrival: rc.seq.Add(1), Time: time.Now(), Key: r.Header.Get(httpsink.HeaderIdempotencyKey)}
	if st, err := leasehold.StampFromHeader(r.Header); err == nil {
		d.Stamp = st
	}
	relay, relayed, err := httpsink.RelayFromHeader(r.Header)
	if err == nil && relayed {
		d.Relay = relay
	}
	rc.mu.Lock()
	down := rc.down503
	var hr *heldRequest
	if !down && relayed && rc.hold != nil {
		hr, rc.hold = rc.hold, nil
	}
	rc.mu.Unlock()
	if down {
		d.Down, d.Status = true, http.StatusServiceUnavailable
		http.Error(w, "the receiver is down", http.StatusServiceUnavailable)
		rc.keep(d)
		return
	}
	if hr != nil {
		hr.got <- relay
		select {
		case <-hr.release:
		case <-r.Context().Done():
		}
		// It arrives now: what the Verifier judges it against is what
		// was recorded meanwhile.
		d.Arrival = rc.seq.Add(1)
	}
	rec := &statusRecorder{ResponseWriter: w}
	rc.handler.ServeHTTP(rec, r.WithContext(context.WithValue(r.Context(), deliveryKey{}, d)))
	d.Status = rec.status
	if d.Status == 0 {
		d.Status = http.StatusOK
	}
	d.Replayed = w.Header().Get(httpsink.HeaderReplayed) == "true"
	if d.Status >= 400 {
		var ref httpsink.Refusal
		if json.Unmarshal(rec.body, &ref) == nil && ref.Error != "" {
			d.Refusal = ref.Error
			if ref.Fence != "" {
				d.Refusal += "/" + string(ref.Fence)
			}
		}
	}
	rc.keep(d)
}

// handle is the receiver's own handler: it takes the effect.
func (rc *receiver) handle(w http.ResponseWriter, r *http.Request) {
	d, _ := r.Context().Value(deliveryKey{}).(*Delivery)
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil || d == nil {
		http.Error(w, "cannot read the body", http.StatusBadRequest)
		return
	}
	d.Body = string(body)
	d.Handled = rc.seq.Add(1)
	rc.mu.Lock()
	rc.handled[d.Stamp.Key] = true
	rc.top = max(rc.top, d.Relay.Epoch)
	rc.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

func (rc *receiver) keep(d *Delivery) {
	rc.mu.Lock()
	rc.records = append(rc.records, *d)
	rc.mu.Unlock()
}

// topRelayEpoch is the highest relay epoch a handler ran for.
func (rc *receiver) topRelayEpoch() leasehold.Epoch {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.top
}

// delivered reports whether a handler ran for the effect key.
func (rc *receiver) delivered(key string) bool {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.handled[key]
}

// deliveries returns every request so far, in arrival order of recording.
func (rc *receiver) deliveries() []Delivery {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return append([]Delivery{}, rc.records...)
}

// writeDeliveries keeps the receiver's record beside the histories, one
// JSON object a line.
func writeDeliveries(path string, ds []Delivery) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(f)
	for _, d := range ds {
		if err := enc.Encode(d); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}

// statusRecorder notes the status written.
type statusRecorder struct {
	http.ResponseWriter
	status int
	body   []byte // the start of an error's body
}

func (s *statusRecorder) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	if s.status >= 400 && len(s.body) < 4096 {
		s.body = append(s.body, b[:min(len(b), 4096-len(s.body))]...)
	}
	return s.ResponseWriter.Write(b)
}
