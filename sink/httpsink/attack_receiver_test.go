package httpsink_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/httpsink"
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
	sc := &script{tries: map[string]int{}, auth: map[string]string{}, answers: map[string][]func(http.ResponseWriter, *http.Request){
		"k429years": {status(429, "", "Retry-After", "999999999"), status(200, "")},
		"k429date":  {status(429, "", "Retry-After", "Fri, 31 Dec 9999 23:59:59 GMT"), status(200, "")},
		"k503date":  {status(503, "", "Retry-After", "Fri, 31 Dec 9999 23:59:59 GMT"), status(200, "")},
		"k429junk":  {status(429, "", "Retry-After", "soon, maybe"), status(200, "")},
		"kdrip":     {drip},
	}}
	srv := httptest.NewServer(sc)
	defer srv.Close()
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
// HTTP guide warns), while effects for the other keep coming. The relay
// gives up its term at each refusal and campaigns again; it stops after
// maxStaleTerms terms in a row "before any delivery", but a delivery to
// the other endpoint within a term resets that count. Then it retakes its
// lock for ever, Ready stays nil, and the refused effect is never
// dead-lettered (a supersede is not a delivery attempt). Whether a
// delivery lands within each term is a matter of timing: the test fails in
// 1 to 4 of 10 runs under -race on a loaded 2-core machine
// (LEASEHOLD_ATTACK_OPEN=1 go test -race -count=10 -run
// TestAttackOneFencedReceiverChurnsTheRelay). It fails if the bad receiver sees ten terms
// without the relay stopping or dead-lettering the refused effect.
func TestAttackOneFencedReceiverChurnsTheRelay(t *testing.T) {
	if os.Getenv("LEASEHOLD_ATTACK_OPEN") == "" {
		t.Skip("known defect: one receiver that supersedes every relay epoch makes the relay give up and retake its lock for ever while another endpoint delivers; its effect is never dead-lettered and Ready stays nil")
	}
	t.Parallel()
	e := newEnv(t, "churn")
	good := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) }))
	defer good.Close()
	var mu sync.Mutex
	terms := map[string]bool{}
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		ep, _ := strconv.ParseUint(r.Header.Get(httpsink.HeaderRelayEpoch), 10, 64)
		mu.Lock()
		terms[r.Header.Get(httpsink.HeaderRelayEpoch)] = true
		mu.Unlock()
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
	stop := make(chan struct{})
	feeding := make(chan struct{})
	go func() { // effects for the good endpoint keep coming
		defer close(feeding)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			h := nats.Header{}
			e.stamp(1, "kgood"+strconv.Itoa(i)).SetHeader(h)
			if _, err := e.js.PublishMsg(context.Background(), &nats.Msg{Subject: e.prefix + ".out.good", Header: h, Data: []byte(`{}`)}); err != nil {
				return
			}
		}
	}()
	defer func() { close(stop); <-feeding }()
	rcfg := e.runnerConfig()
	r := e.startRelay(httpsink.Config{URL: good.URL, Endpoints: map[string]string{"bad": bad.URL},
		Routes: []httpsink.Route{{Subject: e.prefix + ".out.bad", Endpoint: "bad"}}, Coordinator: e.coord("relay-a")}, rcfg)
	deadline := time.After(time.Minute)
	for {
		mu.Lock()
		n := len(terms)
		mu.Unlock()
		if _, err := e.js.Stream(context.Background(), e.prefix+"-sink-dlq"); err == nil {
			for _, m := range e.deadLetters() {
				if m.Header.Get(leasehold.HeaderKey) == "kbad" {
					return // dead-lettered: it holds nothing up
				}
			}
		}
		if n >= 10 {
			t.Fatalf("the bad receiver refused %d terms of the relay, which retook its lock each time and never dead-lettered the refused effect; Ready now: %v", n, r.Ready(context.Background()))
		}
		select {
		case err := <-r.done:
			close(r.done)
			t.Logf("the relay stopped: %v", err)
			return
		case <-deadline:
			t.Fatalf("neither ten terms, nor a stop, nor a dead letter within a minute (terms: %d)", n)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
