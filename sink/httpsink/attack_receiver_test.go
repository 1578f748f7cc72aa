package httpsink_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/telemetry"
)

// hits records what a receiver was sent, by method, path and effect key.
type hits struct {
	mu   sync.Mutex
	seen map[string][]string // "METHOD path key" -> bodies
}

func (h *hits) add(r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	h.mu.Lock()
	defer h.mu.Unlock()
	k := r.Method + " " + r.URL.Path + " " + r.Header.Get(leasehold.HeaderKey)
	h.seen[k] = append(h.seen[k], string(b))
}

func (h *hits) get(k string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.seen[k]...)
}

// A relay allowed to follow redirects (MaxRedirects) follows them to its
// endpoint's origin only, and only those that keep the method and the
// body (307, 308). A 301, 302 or 303 answer to a POST would make Go's
// client send a GET without a body to the new place; were that GET
// answered 2xx, the relay would count the effect delivered though its body
// never reached the receiver's POST handler: a committed job's effect
// lost. The test has a receiver move its hook to a path with a trailing
// slash (as web frameworks do) and fails unless each effect's body is
// POSTed there once (the 307), or the effect is dead-lettered with the
// redirect's status (the others) and no GET is sent.
func TestAttackRedirectedPostLosesItsBody(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "redirpost")
	h := &hits{seen: map[string][]string{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.add(r)
		switch {
		case r.URL.Path == "/hook":
			code := map[string]int{"k301": 301, "k302": 302, "k303": 303, "k307": 307}[r.Header.Get(leasehold.HeaderKey)]
			w.Header().Set("Location", "/hook/")
			w.WriteHeader(code)
		case r.Method == http.MethodGet:
			_, _ = w.Write([]byte("<html>the hooks page</html>"))
		default:
			w.WriteHeader(http.StatusOK)
		}
	}))
	defer srv.Close()
	e.barrier(1)
	var last uint64
	keys := []string{"k301", "k302", "k303", "k307"}
	for _, k := range keys {
		last = e.publish("hook", e.stamp(1, k), []byte(`{"effect":"`+k+`"}`), nil)
	}
	r := e.startRelay(httpsink.Config{URL: srv.URL + "/hook", MaxRedirects: 3, Coordinator: e.coord("relay-a")}, e.runnerConfig())
	r.waitPosition(t, last)
	dead := map[string]string{}
	for _, m := range e.deadLetters() {
		dead[m.Header.Get(leasehold.HeaderKey)] = m.Header.Get("Leasehold-Sink-Error")
	}
	for _, k := range keys {
		posted := h.get("POST /hook/ " + k)
		if got := h.get("GET /hook/ " + k); len(got) != 0 {
			t.Errorf("%s: the relay sent %d GETs without the effect's body", k, len(got))
		}
		if msg, ok := dead[k]; ok {
			if k == "k307" || !strings.Contains(msg, k[1:]) || !strings.Contains(msg, "without its body") {
				t.Errorf("%s: dead-lettered with %q; want the 307 delivered, and the others' dead letters to name their status and why", k, msg)
			}
			continue
		}
		if len(posted) == 1 && posted[0] == `{"effect":"`+k+`"}` {
			if k != "k307" {
				t.Errorf("%s: followed", k)
			}
			continue
		}
		t.Errorf("%s: not dead-lettered, and its body reached the receiver's POST handler as %q", k, posted)
	}
}

// A receiver that lies about when to try again (Retry-After of 31 years,
// a date in year 9999, garbage) holds the relay back at most
// MaxRetryAfter per try; one that answers 200 and then sends its body for
// ever holds a request at most Timeout, and the effect counts as
// delivered. The test fails if the runner does not pass every effect
// within a minute (it would wait years, or for ever, otherwise).
func TestAttackReceiverStallsTheRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "stalls")
	drip := func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		for {
			select {
			case <-r.Context().Done():
				return
			case <-time.After(10 * time.Millisecond):
				if _, err := w.Write([]byte("x")); err != nil {
					return
				}
				w.(http.Flusher).Flush()
			}
		}
	}
	sc, srv := serveScript(t, map[string][]func(http.ResponseWriter, *http.Request){
		"k429years": {status(429, "", "Retry-After", "999999999"), status(200, "")},
		"k429date":  {status(429, "", "Retry-After", "Fri, 31 Dec 9999 23:59:59 GMT"), status(200, "")},
		"k503date":  {status(503, "", "Retry-After", "Fri, 31 Dec 9999 23:59:59 GMT"), status(200, "")},
		"k429junk":  {status(429, "", "Retry-After", "soon, maybe"), status(200, "")},
		"kdrip":     {drip},
	})
	e.barrier(1)
	var last uint64
	keys := []string{"k429years", "k429date", "k503date", "k429junk", "kdrip"}
	for _, k := range keys {
		last = e.publish("hook."+k, e.stamp(1, k), []byte(`{}`), nil)
	}
	r := e.startRelay(httpsink.Config{URL: srv.URL, Coordinator: e.coord("relay-a"), MaxRetryAfter: 300 * time.Millisecond, Timeout: time.Second}, e.runnerConfig())
	r.waitPosition(t, last)
	if dl := e.deadLetters(); len(dl) != 0 {
		t.Errorf("%d dead letters (first: %s), want every effect delivered", len(dl), dl[0].Header.Get("Leasehold-Sink-Error"))
	}
	for _, k := range keys[:4] {
		if n := sc.count(k); n < 2 {
			t.Errorf("%s: %d requests, want the refusal and the delivery", k, n)
		}
	}
}

// A relay with two endpoints, one of which refuses every request as
// superseded (its Verifier holds a relay epoch far above any the lease
// bucket issued: a forged request with a huge relay epoch did it, as the
// HTTP guide warns), while the other takes its effects. Each refusal
// ended the relay's term, and a delivery to the other endpoint reset the
// bound on refused terms, so the relay gave up and retook its lock for
// ever, Ready stayed nil, and the refused effect was never dead-lettered
// (a refusal as superseded is not a try). The bound is now the
// endpoint's, reset only by its own deliveries: past it, that endpoint is
// fenced out (down in Ready, OnEndpoint and the gauge) and its effect is
// dead-lettered saying why, while the relay goes on delivering.
//
// Nothing here depends on timing: the bad receiver answers its first
// term only once the good one has seen two requests of that term, so the
// relay has taken the first's answer (the good effects go one after
// another); the test then waits for the dead letter, and fails if the bad
// receiver sees more than three terms, or the relay stops.
func TestAttackOneFencedReceiverChurnsTheRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "churn")
	var (
		mu       sync.Mutex
		changed  = make(chan struct{})
		goodSeen = map[string]int{} // requests by relay epoch
		goodKeys = map[string]int{}
		terms    []string // relay epochs the bad receiver refused, in order
	)
	note := func(f func()) {
		mu.Lock()
		f()
		close(changed)
		changed = make(chan struct{})
		mu.Unlock()
	}
	good := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		note(func() {
			goodSeen[r.Header.Get(httpsink.HeaderRelayEpoch)]++
			goodKeys[r.Header.Get(leasehold.HeaderKey)]++
		})
		w.WriteHeader(http.StatusOK)
	}))
	defer good.Close()
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		epoch := r.Header.Get(httpsink.HeaderRelayEpoch)
		for {
			mu.Lock()
			first := len(terms) == 0 || terms[0] == epoch
			ready := !first || goodSeen[epoch] >= 2
			ch := changed
			mu.Unlock()
			if ready {
				break
			}
			select {
			case <-ch:
			case <-r.Context().Done():
				return
			}
		}
		note(func() {
			if len(terms) == 0 || terms[len(terms)-1] != epoch {
				terms = append(terms, epoch)
			}
		})
		ep, _ := strconv.ParseUint(epoch, 10, 64)
		ref, _ := json.Marshal(map[string]any{"error": "stale_epoch", "fence": "relay", "scope": r.Header.Get(httpsink.HeaderRelayScope), "partition": 0,
			"epoch": ep, "acquisition": r.Header.Get(httpsink.HeaderRelayAcquisition), "max": ep + 1_000_000, "holder": "relay-forged", "message": "superseded"})
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusConflict)
		_, _ = w.Write(ref)
	}))
	defer bad.Close()
	e.barrier(1)
	for i := range 20 {
		e.publish("good", e.stamp(1, "kfirst"+strconv.Itoa(i)), []byte(`{}`), nil)
	}
	e.publish("bad", e.stamp(1, "kbad"), []byte(`{}`), nil)
	for i := range 20 {
		e.publish("good", e.stamp(1, "kthen"+strconv.Itoa(i)), []byte(`{}`), nil)
	}
	reader := sdkmetric.NewManualReader()
	heard := make(chan httpsink.EndpointHealth, 1024)
	r := e.startRelay(httpsink.Config{URL: good.URL, Endpoints: map[string]string{"bad": bad.URL},
		Routes: []httpsink.Route{{Subject: e.prefix + ".out.bad", Endpoint: "bad"}}, Coordinator: e.coord("relay-a"),
		Telemetry:  telemetry.Config{MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))},
		OnEndpoint: func(h httpsink.EndpointHealth) { heard <- h }}, e.runnerConfig())
	deadline := time.After(time.Minute)
	for dead := false; !dead; {
		mu.Lock()
		n, ch := len(terms), changed
		mu.Unlock()
		if n > 3 {
			t.Fatalf("the bad receiver refused %d terms of the relay, which retook its lock each time; Ready now: %v", n, r.Ready(context.Background()))
		}
		if _, err := e.js.Stream(context.Background(), e.prefix+"-sink-dlq"); err == nil {
			for _, m := range e.deadLetters() {
				if m.Header.Get(leasehold.HeaderKey) != "kbad" {
					t.Fatalf("%s was dead-lettered: %s", m.Header.Get(leasehold.HeaderKey), m.Header.Get("Leasehold-Sink-Error"))
				}
				dead = true
				if msg := m.Header.Get("Leasehold-Sink-Error"); !strings.Contains(msg, "refused every relay epoch") || !strings.Contains(msg, "endpoint bad") {
					t.Errorf("kbad's dead letter says %q: want the endpoint, and that its receiver refused every relay epoch", msg)
				}
			}
		}
		if dead {
			break
		}
		select {
		case err := <-r.done:
			r.done <- err // for the cleanup
			t.Fatalf("the relay stopped: %v", err)
		case <-deadline:
			t.Fatalf("kbad not dead-lettered within a minute (terms refused: %d; ready: %v)", n, r.Ready(context.Background()))
		case <-ch:
		case <-time.After(50 * time.Millisecond): // the dead-letter stream is polled
		}
	}
	// The relay goes on delivering the good endpoint's effects, under the
	// lock it holds, and the bad endpoint is down.
	last := e.publish("good", e.stamp(1, "klast"), []byte(`{}`), nil)
	r.waitPosition(t, last)
	mu.Lock()
	for _, k := range []string{"kfirst0", "kfirst19", "kthen0", "kthen19", "klast"} {
		if goodKeys[k] == 0 {
			t.Errorf("%s never reached the good receiver", k)
		}
	}
	t.Logf("the bad receiver refused terms %v", terms)
	mu.Unlock()
	ready := r.Ready(context.Background())
	if ready == nil || !strings.Contains(ready.Error(), "endpoint bad") || !strings.Contains(ready.Error(), "refused every relay epoch") {
		t.Errorf("Ready says %v: want the bad endpoint named, fenced out", ready)
	}
	if err := r.Ready(context.Background()); err != nil && strings.Contains(err.Error(), "endpoint default") {
		t.Errorf("Ready blames the good endpoint: %v", err)
	}
	var down *httpsink.EndpointHealth
	for len(heard) > 0 {
		h := <-heard
		if h.Endpoint == "default" && h.Down {
			t.Errorf("OnEndpoint heard the good endpoint down: %+v", h)
		}
		if h.Endpoint == "bad" {
			down = &h
		}
	}
	if down == nil || !down.Down || !strings.Contains(down.Err, "refused every relay epoch") || down.Origin != bad.URL {
		t.Errorf("OnEndpoint last heard of the bad endpoint %+v: want it down, fenced out", down)
	}
	if g := downGauge(t, reader); g["bad"] != 1 || g["default"] != 0 {
		t.Errorf("leasehold.http.endpoint.down: %v, want bad 1 and default 0", g)
	}
	select {
	case err := <-r.done:
		r.done <- err
		t.Errorf("the relay stopped: %v", err)
	default:
	}
}

// downGauge reads leasehold.http.endpoint.down by endpoint.
func downGauge(t *testing.T, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == "leasehold.http.endpoint.down" {
				for _, p := range g.DataPoints {
					v, _ := p.Attributes.Value("leasehold.endpoint")
					out[v.AsString()] = p.Value
				}
			}
		}
	}
	return out
}
