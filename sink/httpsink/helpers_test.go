package httpsink_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/internal/testpar"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) {
	testpar.Raise(4)
	testleak.VerifyTestMain(m)
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// env is one test's NATS server, lease bucket and effect log.
type env struct {
	t      *testing.T
	srv    *natstest.Server
	js     jetstream.JetStream
	bucket *coordinator.Bucket
	prefix string
}

func newEnv(t *testing.T, prefix string) *env {
	t.Helper()
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	b, err := coordinator.Provision(ctxFor(t, time.Minute), js, coordinator.BucketConfig{Bucket: prefix + "-leases", MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// The effect log, as worker.ProvisionJobs creates it.
	if _, err := js.CreateStream(ctxFor(t, time.Minute), jetstream.StreamConfig{Name: prefix + "-effects", Subjects: []string{prefix + ".out.>"},
		Storage: jetstream.FileStorage, DenyDelete: true, DenyPurge: true}); err != nil {
		t.Fatal(err)
	}
	return &env{t: t, srv: srv, js: js, bucket: b, prefix: prefix}
}

// coord is a coordinator of the lease bucket for one relay process.
func (e *env) coord(worker string) *coordinator.Coordinator {
	e.t.Helper()
	c, err := coordinator.New(e.bucket, coordinator.Config{Worker: worker, TTL: 2 * time.Second, Logger: quiet()})
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// runnerConfig is the stream sink runner every relay of the test runs.
func (e *env) runnerConfig() streamsink.Config {
	return streamsink.Config{
		Prefix: e.prefix, Provision: true, Consumer: e.prefix + "-relay", Name: "relay",
		MaxDeliveries: 5, MaxBackoff: 20 * time.Millisecond, AckWait: time.Second, FetchWait: 100 * time.Millisecond,
		Logger: quiet(),
	}
}

// relay is a Relay running a runner under its lock.
type relay struct {
	*httpsink.Relay
	cancel context.CancelFunc
	done   chan error
}

func (e *env) startRelay(cfg httpsink.Config, rc streamsink.Config) *relay {
	e.t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quiet()
	}
	r, err := httpsink.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	rr := &relay{Relay: r, cancel: cancel, done: make(chan error, 1)}
	go func() { rr.done <- r.RunSink(ctx, e.js, rc) }()
	e.t.Cleanup(func() { rr.stop() })
	return rr
}

// stop ends the relay as a killed process would end: its requests in
// flight are cut off, and it saves nothing more.
func (rr *relay) stop() error {
	rr.cancel()
	err, ok := <-rr.done
	if ok {
		close(rr.done)
	}
	return err
}

// waitPosition waits until the relay's runner has handled and saved log
// position seq.
func (rr *relay) waitPosition(t testing.TB, seq uint64) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	for {
		if rn := rr.Runner(); rn != nil {
			wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			err := rn.WaitPosition(wctx, seq)
			cancel()
			if err == nil {
				return
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the relay's runner did not reach log position %d within a minute (ready: %v)", seq, rr.Ready(context.Background()))
		case err := <-rr.done:
			t.Fatalf("the relay stopped: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// eventually waits until cond holds, for up to a minute.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within a minute", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// publish writes one stamped effect of partition 0 into the effect log, as
// a worker does, and returns its log position.
func (e *env) publish(subject string, st leasehold.Stamp, data []byte, extra nats.Header) uint64 {
	e.t.Helper()
	h := nats.Header{}
	for k, v := range extra {
		h[k] = v
	}
	st.SetHeader(h)
	ack, err := e.js.PublishMsg(ctxFor(e.t, 30*time.Second), &nats.Msg{Subject: e.prefix + ".out." + subject, Header: h, Data: data})
	if err != nil {
		e.t.Fatalf("publish %s: %v", st.Key, err)
	}
	return ack.Sequence
}

// barrier publishes the barrier a worker publishes when it acquires
// partition 0 at epoch ep.
func (e *env) barrier(ep leasehold.Epoch) uint64 {
	e.t.Helper()
	h := nats.Header{}
	e.stamp(ep, leasehold.BarrierKey(e.prefix, 0, ep)).SetHeader(h)
	h.Set(leasehold.HeaderBarrier, "1")
	ack, err := e.js.PublishMsg(ctxFor(e.t, 30*time.Second), &nats.Msg{Subject: e.prefix + ".out.barrier", Header: h})
	if err != nil {
		e.t.Fatal(err)
	}
	return ack.Sequence
}

// stamp is the stamp of a write under epoch ep of partition 0.
func (e *env) stamp(ep leasehold.Epoch, key string) leasehold.Stamp {
	return leasehold.Stamp{Scope: e.prefix, Epoch: ep, Acquisition: fmt.Sprintf("a%d", ep), Key: key, Worker: fmt.Sprintf("w%d", ep)}
}

// deadLetters reads the runner's dead-letter stream.
func (e *env) deadLetters() []*jetstream.RawStreamMsg {
	e.t.Helper()
	ctx := ctxFor(e.t, 30*time.Second)
	s, err := e.js.Stream(ctx, e.prefix+"-sink-dlq")
	if err != nil {
		e.t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		out = append(out, m)
	}
	return out
}

// receiver is an HTTP receiver in the test process: a handler that
// records what reached it, behind a Verifier.
type receiver struct {
	*httptest.Server
	v *httpsink.Verifier

	mu      sync.Mutex
	calls   map[string]int                 // handler calls by effect key
	order   []string                       // keys in the order the handler saw them
	relays  map[string][]leasehold.Lease   // relay leases by key
	keys    map[string]map[string]struct{} // Idempotency-Key values seen by key, before the verifier
	answer  func(w http.ResponseWriter, r *http.Request, st leasehold.Stamp, n int) bool
	changed chan struct{}
}

func newReceiver(t testing.TB, vc httpsink.VerifierConfig) *receiver {
	t.Helper()
	rc := &receiver{calls: map[string]int{}, relays: map[string][]leasehold.Lease{}, keys: map[string]map[string]struct{}{}, changed: make(chan struct{})}
	if vc.Logger == nil {
		vc.Logger = quiet()
	}
	v, err := httpsink.NewVerifier(vc)
	if err != nil {
		t.Fatal(err)
	}
	rc.v = v
	rc.Server = httptest.NewServer(rc.handler())
	t.Cleanup(rc.Close)
	return rc
}

func (rc *receiver) handler() http.Handler {
	inner := rc.v.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st, _ := httpsink.StampFrom(r.Context())
		_, _ = io.ReadAll(r.Body)
		rc.mu.Lock()
		rc.calls[st.Key]++
		n := rc.calls[st.Key]
		rc.order = append(rc.order, st.Key)
		if l, ok := httpsink.RelayFrom(r.Context()); ok {
			rc.relays[st.Key] = append(rc.relays[st.Key], l)
		}
		answer := rc.answer
		close(rc.changed)
		rc.changed = make(chan struct{})
		rc.mu.Unlock()
		if answer != nil && answer(w, r, st, n) {
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if k := r.Header.Get(leasehold.HeaderKey); k != "" {
			rc.mu.Lock()
			if rc.keys[k] == nil {
				rc.keys[k] = map[string]struct{}{}
			}
			rc.keys[k][r.Header.Get(httpsink.HeaderIdempotencyKey)] = struct{}{}
			rc.mu.Unlock()
		}
		inner.ServeHTTP(w, r)
	})
}

func (rc *receiver) count(key string) int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.calls[key]
}

func (rc *receiver) snapshot() map[string]int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	out := make(map[string]int, len(rc.calls))
	for k, n := range rc.calls {
		out[k] = n
	}
	return out
}

// waitCalls waits until the handler has seen every key of want at least
// as often as want says.
func (rc *receiver) waitCalls(t testing.TB, want map[string]int) {
	t.Helper()
	deadline := time.After(time.Minute)
	for {
		rc.mu.Lock()
		ok := true
		for k, n := range want {
			if rc.calls[k] < n {
				ok = false
			}
		}
		ch := rc.changed
		rc.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("the receiver saw %v within a minute, want at least %v", rc.snapshot(), want)
		}
	}
}

// effect is a standalone effect for a test table.
func effect(st leasehold.Stamp, subject string, data string) sink.Effect {
	return sink.Effect{Stamp: st, Subject: subject, Data: []byte(data)}
}

// script answers each effect key's requests from a list of answers, the
// last repeated; it counts the requests.
type script struct {
	mu      sync.Mutex
	answers map[string][]func(w http.ResponseWriter, r *http.Request)
	tries   map[string]int
	auth    map[string]string
}

func (s *script) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	k := r.Header.Get(leasehold.HeaderKey)
	s.mu.Lock()
	s.tries[k]++
	n := s.tries[k]
	s.auth[k] = r.Header.Get("Authorization")
	as := s.answers[k]
	s.mu.Unlock()
	if len(as) == 0 {
		w.WriteHeader(http.StatusOK)
		return
	}
	as[min(n, len(as))-1](w, r)
}

func (s *script) count(k string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tries[k]
}

func status(code int, body string, header ...string) func(w http.ResponseWriter, r *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		w.WriteHeader(code)
		_, _ = w.Write([]byte(body))
	}
}

// hang answers nothing until the client gives up.
func hang(w http.ResponseWriter, r *http.Request) {
	// The server notices a closed connection once the body is read.
	_, _ = io.Copy(io.Discard, r.Body)
	<-r.Context().Done()
}

// serveScript serves a script of answers, by effect key, until the test
// ends.
func serveScript(t *testing.T, answers map[string][]func(http.ResponseWriter, *http.Request)) (*script, *httptest.Server) {
	t.Helper()
	sc := &script{tries: map[string]int{}, auth: map[string]string{}, answers: answers}
	srv := httptest.NewServer(sc)
	t.Cleanup(srv.Close)
	return sc, srv
}
