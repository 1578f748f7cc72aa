package main

import (
	"context"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/sink/httpsink"
)

// hookReceiver counts the requests a Verifier passed and its handler
// took, by effect key; while failing is set, the handler answers 503.
type hookReceiver struct {
	failing atomic.Bool
	tried   atomic.Int64

	mu      sync.Mutex
	calls   map[string]int
	changed chan struct{}
	v       *httpsink.Verifier
}

func newHookReceiver(t *testing.T) *hookReceiver {
	v, err := httpsink.NewVerifier(httpsink.VerifierConfig{RequireRelay: true})
	if err != nil {
		t.Fatal(err)
	}
	return &hookReceiver{calls: map[string]int{}, changed: make(chan struct{}), v: v}
}

func (h *hookReceiver) handler() http.Handler {
	return h.v.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st, _ := httpsink.StampFrom(r.Context())
		if h.tried.Add(1); h.failing.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		h.mu.Lock()
		h.calls[st.Key]++
		close(h.changed)
		h.changed = make(chan struct{})
		h.mu.Unlock()
	}))
}

// wait waits until n keys were delivered, and returns the calls by key.
func (h *hookReceiver) wait(t *testing.T, ctx context.Context, n int) map[string]int {
	t.Helper()
	for {
		h.mu.Lock()
		got, ch := len(h.calls), h.changed
		calls := make(map[string]int, got)
		for k, c := range h.calls {
			calls[k] = c
		}
		h.mu.Unlock()
		if got >= n {
			return calls
		}
		select {
		case <-ch:
		case <-ctx.Done():
			t.Fatalf("the receiver got %d of %d effects", got, n)
		}
	}
}

// `leasehold sink --kind http` delivers every job's effect to the
// receiver through its verifier, once each. While the receiver is down,
// /readyz fails and names the endpoint by its origin, never its path or
// the --header value, and leasehold_http_endpoint_down is 1; once it is
// up, everything arrives, /readyz passes and the gauge is 0.
func TestSinkHTTPDelivers(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, 2*time.Minute)
	if out, err := run(t, ctx, "init", "--nats", s.URL(), "--partitions", "2"); err != nil {
		t.Fatalf("init: %v\n%s", err, out)
	}
	recvAddr, sinkAddr := freeAddr(t), freeAddr(t)
	url := "http://" + recvAddr + "/hooks/secret-path"
	background(t, "worker", "--nats", s.URL(), "--partitions", "2", "--worker-id", "w1", "--ttl", "2s", "--http", "", "--log-level", "warn")
	background(t, "sink", "--nats", s.URL(), "--kind", "http", "--url", url, "--header", "Authorization: Bearer s3cr3t",
		"--lock-ttl", "2s", "--max-deliveries", "1000", "--max-backoff", "100ms", "--http", sinkAddr, "--log-level", "warn")
	if out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "--partitions", "2", "-n", "20"); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	var body string
	for {
		var code int
		code, body = httpGet("http://" + sinkAddr + "/readyz")
		if code == http.StatusServiceUnavailable && strings.Contains(body, "has failed every request") {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("/readyz did not report the receiver down: %d %s", code, body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("/readyz while the receiver is down: %s", body)
	if !strings.Contains(body, "http://"+recvAddr) || strings.Contains(body, "secret-path") || strings.Contains(body, "s3cr3t") {
		t.Errorf("/readyz should name the origin only: %s", body)
	}
	if _, m := httpGet("http://" + sinkAddr + "/metrics"); !strings.HasSuffix(grepLines(m, "leasehold_http_endpoint_down{"), " 1") {
		t.Errorf("/metrics while the receiver is down: %s", grepLines(m, "leasehold_http"))
	}
	ln, err := net.Listen("tcp", recvAddr)
	if err != nil {
		t.Fatal(err)
	}
	h := newHookReceiver(t)
	srv := &http.Server{Handler: h.handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	calls := h.wait(t, ctx, 20)
	for k, n := range calls {
		if n != 1 {
			t.Errorf("effect %s reached the handler %d times", k, n)
		}
	}
	for {
		code, body := httpGet("http://" + sinkAddr + "/readyz")
		if code == http.StatusOK {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("/readyz once the receiver is up: %d %s", code, body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code, body := httpGet("http://" + sinkAddr + "/metrics"); code != 200 || !strings.Contains(body, `leasehold_http_requests_total`) ||
		!strings.HasSuffix(grepLines(body, "leasehold_http_endpoint_down{"), " 0") {
		t.Errorf("/metrics: %d\n%s", code, grepLines(body, "leasehold_http"))
	}
}

// The sink refuses flags it cannot run, before it connects to anything
// but NATS, and an error never shows a --header value.
func TestSinkHTTPFlags(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, time.Minute)
	if out, err := run(t, ctx, "init", "--nats", s.URL(), "--partitions", "1"); err != nil {
		t.Fatalf("init: %v\n%s", err, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "needs --url"},
		{[]string{"--url", "ftp://example.com/x"}, `scheme "ftp"`},
		{[]string{"--url", "http://127.0.0.1:1/x", "--header", "Authorization s3cr3t"}, "'Name: value'"},
		{[]string{"--url", "http://127.0.0.1:1/x", "--header", "Idempotency-Key: mine"}, "the relay sets it itself"},
		{[]string{"--url", "http://127.0.0.1:1/x", "--route", "leasehold.out.*=billing"}, `endpoint "billing" is not configured`},
	} {
		args := append([]string{"sink", "--nats", s.URL(), "--kind", "http", "--http", ""}, c.args...)
		out, err := run(t, ctx, args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error saying %q\n%s", c.args, err, c.want, out)
		}
		if err != nil && strings.Contains(err.Error()+out, "s3cr3t") {
			t.Errorf("%v: the error shows the header's value: %v", c.args, err)
		}
	}
}

// Effects a receiver keeps failing go to the sink's dead-letter stream
// after --max-deliveries tries, and are lost to nobody: once the
// receiver is fixed, `leasehold dlq replay --sink --all` sends them back
// into the effect log and the relay delivers each once, with its key.
func TestSinkHTTPDeadLettersReplayed(t *testing.T) {
	t.Parallel()
	s, ctx := initialized(t, 2*time.Minute, "--partitions", "2")
	h := newHookReceiver(t)
	h.failing.Store(true)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h.handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	background(t, "worker", "--nats", s.URL(), "--partitions", "2", "--worker-id", "w1", "--ttl", "2s", "--http", "", "--log-level", "warn")
	background(t, "sink", "--nats", s.URL(), "--kind", "http", "--url", "http://"+ln.Addr().String()+"/hooks",
		"--max-deliveries", "3", "--max-backoff", "20ms", "--http", "", "--log-level", "error")
	mustRun(t, ctx, "enqueue", "--nats", s.URL(), "--partitions", "2", "-n", "5")
	js := s.JetStream(t)
	for {
		if st, err := js.Stream(ctx, "leasehold-sink-dlq"); err == nil {
			if info, err := st.Info(ctx); err == nil && info.State.Msgs == 5 {
				break
			}
		}
		if ctx.Err() != nil {
			t.Fatalf("the 5 effects were not dead-lettered (%d requests)", h.tried.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := h.tried.Load(); n < 15 {
		t.Errorf("%d requests before the dead letters, want at least 3 tries of each of 5", n)
	}
	h.failing.Store(false)
	out := mustRun(t, ctx, "dlq", "replay", "--all", "--sink", "--nats", s.URL())
	t.Logf("dlq replay --sink --all:\n%s", out)
	for k, n := range h.wait(t, ctx, 5) {
		if n != 1 {
			t.Errorf("effect %s reached the handler %d times", k, n)
		}
	}
}
