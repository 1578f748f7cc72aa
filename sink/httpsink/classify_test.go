package httpsink_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testbuf"
	"github.com/leasehold/leasehold/sink/httpsink"
)

// Each answer is classified: 5xx, 408, 429 (with its Retry-After) and
// 409 (a Verifier's in-progress answer, or a receiver's own) are retried
// and delivered when the receiver takes them; a 5xx for ever and a 409 for
// ever are dead-lettered after MaxDeliveries tries with the status and a
// bounded excerpt of the body; other 4xx and a 3xx are dead-lettered at
// once. The requests' Timeout is a minute, which no loaded scheduler
// reaches, so each answer counts as what it is (timeouts:
// TestClassificationTimeout).
func TestClassification(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "classify")
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Errorf("a redirect was followed to %s", r.URL)
	}))
	defer other.Close()
	inProgress := `{"error":"in_progress","partition":0,"key":"k409busy","message":"a request with this Idempotency-Key is being handled; try again"}`
	long := strings.Repeat("x", 10000) + "THE-END"
	sc, srv := serveScript(t, map[string][]func(http.ResponseWriter, *http.Request){
		"k500":      {status(500, long)},
		"k503":      {status(503, "busy"), status(503, "busy"), status(200, "")},
		"k408":      {status(408, ""), status(200, "")},
		"k429":      {status(429, "slow down", "Retry-After", "1"), status(200, "")},
		"k409busy":  {status(409, inProgress, "Content-Type", "application/json"), status(200, "")},
		"k409plain": {status(409, "busy", "Retry-After", "1"), status(200, "")},
		"k409ever":  {status(409, "conflict")},
		"k400":      {status(400, "bad payload")},
		"k404":      {status(404, "no such hook")},
		"k301":      {status(301, "", "Location", other.URL+"/elsewhere")},
	})
	retried := map[string]int{"k503": 3, "k408": 2, "k429": 2, "k409busy": 2, "k409plain": 2}
	atOnce := []string{"k400", "k404", "k301"}
	exhausted := []string{"k500", "k409ever"}
	e.barrier(1)
	var last uint64
	for _, k := range []string{"k500", "k503", "k408", "k429", "k409busy", "k409plain", "k409ever", "k400", "k404", "k301"} {
		last = e.publish("hook", e.stamp(1, k), []byte(`{}`), nil)
	}
	rcfg := e.runnerConfig()
	rcfg.MaxDeliveries = 4
	r := e.startRelay(httpsink.Config{URL: srv.URL, Coordinator: e.coord("relay-a"), Timeout: time.Minute}, rcfg)
	r.waitPosition(t, last)
	for k, n := range retried {
		if got := sc.count(k); got != n {
			t.Errorf("%s: %d requests, want %d", k, got, n)
		}
	}
	dead := map[string]http.Header{}
	for _, m := range e.deadLetters() {
		dead[m.Header.Get(leasehold.HeaderKey)] = http.Header(m.Header)
	}
	for k := range retried {
		if _, ok := dead[k]; ok {
			t.Errorf("%s was dead-lettered, want delivered", k)
		}
	}
	for _, k := range atOnce {
		h, ok := dead[k]
		switch {
		case !ok:
			t.Errorf("%s was not dead-lettered", k)
		case h.Get("Leasehold-Sink-Tries") != "1" || sc.count(k) > 2:
			// A request in the batch call, and one alone: the runner hands
			// a failed batch's effects over one by one.
			t.Errorf("%s: dead-lettered after %s tries (%d requests), want at once", k, h.Get("Leasehold-Sink-Tries"), sc.count(k))
		}
	}
	for _, k := range exhausted {
		h, ok := dead[k]
		switch {
		case !ok:
			t.Errorf("%s was not dead-lettered", k)
		case h.Get("Leasehold-Sink-Tries") != "4" || sc.count(k) < 4 || sc.count(k) > 5:
			t.Errorf("%s: dead-lettered after %s tries (%d requests), want MaxDeliveries (4)", k, h.Get("Leasehold-Sink-Tries"), sc.count(k))
		}
	}
	msg := dead["k500"].Get("Leasehold-Sink-Error")
	if !strings.Contains(msg, "500 Internal Server Error") || !strings.Contains(msg, "body: xxxx") || strings.Contains(msg, "THE-END") || len(msg) > 512 {
		t.Errorf("the 500's dead letter says %q: want the status and a bounded excerpt of the body", msg)
	}
	if msg := dead["k301"].Get("Leasehold-Sink-Error"); !strings.Contains(msg, "301") || !strings.Contains(msg, "redirect") {
		t.Errorf("the 301's dead letter says %q", msg)
	}
}

// A request its receiver never answers times out after Config.Timeout and
// counts as a try: retried, and dead-lettered after MaxDeliveries tries
// with the timeout named; an effect whose first request timed out is
// delivered when the receiver answers a later one. Every timeout here is
// a handler that never answers, so it times out however slow the machine;
// the answered tries have MaxDeliveries (1000) to land within Timeout.
func TestClassificationTimeout(t *testing.T) {
	t.Parallel()
	t.Run("for ever", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, "timeoutever")
		sc, srv := serveScript(t, map[string][]func(http.ResponseWriter, *http.Request){
			"kslowever": {hang},
		})
		e.barrier(1)
		last := e.publish("hook", e.stamp(1, "kslowever"), []byte(`{}`), nil)
		rcfg := e.runnerConfig()
		rcfg.MaxDeliveries = 4
		r := e.startRelay(httpsink.Config{URL: srv.URL, Coordinator: e.coord("relay-a"), Timeout: 100 * time.Millisecond}, rcfg)
		r.waitPosition(t, last)
		dl := e.deadLetters()
		if len(dl) != 1 || dl[0].Header.Get(leasehold.HeaderKey) != "kslowever" {
			t.Fatalf("%d dead letters, want kslowever's", len(dl))
		}
		h := dl[0].Header
		// A try in the batch call, and MaxDeliveries alone: the runner
		// hands a failed batch's effects over one by one. A try whose
		// Timeout passes before its request reaches the receiver (a busy
		// machine) counts as a try and is not seen there, so the
		// receiver sees at most one request a try, and at least one.
		if n := sc.count("kslowever"); h.Get("Leasehold-Sink-Tries") != "4" || n < 1 || n > 5 {
			t.Errorf("dead-lettered after %s tries (%d requests), want MaxDeliveries (4)", h.Get("Leasehold-Sink-Tries"), sc.count("kslowever"))
		}
		if msg := h.Get("Leasehold-Sink-Error"); !strings.Contains(msg, "Timeout") {
			t.Errorf("the timeout's dead letter says %q", msg)
		}
	})
	t.Run("once", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, "timeoutonce")
		gaveUp := make(chan struct{})
		sc, srv := serveScript(t, map[string][]func(http.ResponseWriter, *http.Request){
			"kslow": {func(w http.ResponseWriter, r *http.Request) { hang(w, r); close(gaveUp) }, status(200, "")},
		})
		e.barrier(1)
		last := e.publish("hook", e.stamp(1, "kslow"), []byte(`{}`), nil)
		rcfg := e.runnerConfig()
		rcfg.MaxDeliveries = 1000
		r := e.startRelay(httpsink.Config{URL: srv.URL, Coordinator: e.coord("relay-a"), Timeout: 200 * time.Millisecond}, rcfg)
		r.waitPosition(t, last)
		select {
		case <-gaveUp: // the server saw the relay close the request
		case <-time.After(time.Minute):
			t.Errorf("the relay did not give up on the request its receiver never answered")
		}
		if n := sc.count("kslow"); n < 2 {
			t.Errorf("%d requests, want the one that timed out and a retry", n)
		}
		if dl := e.deadLetters(); len(dl) != 0 {
			t.Errorf("%d dead letters (first: %s), want kslow delivered", len(dl), dl[0].Header.Get("Leasehold-Sink-Error"))
		}
	})
}

// Credentials in configuration never show: not in logs, errors, dead
// letters or Ready, though requests fail every way they can; the header
// is sent all the same.
func TestCredentialsNeverShown(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "secrets")
	sc, srv := serveScript(t, map[string][]func(http.ResponseWriter, *http.Request){
		"k500": {status(500, "oops")},
		"k401": {status(401, "who are you")},
		"kcut": {func(w http.ResponseWriter, r *http.Request) {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				conn.Close()
			}
		}},
	})
	u, _ := url.Parse(srv.URL)
	secrets := []string{"s3cr3t-bearer", "pa55word", "T0KENPATH", "QSECRET"}
	endpoint := "http://hook-user:pa55word@" + u.Host + "/hooks/T0KENPATH?sig=QSECRET"
	logs := &testbuf.Buffer{}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	e.barrier(1)
	var last uint64
	for _, k := range []string{"k500", "k401", "kcut", "kok"} {
		last = e.publish("hook", e.stamp(1, k), []byte(`{}`), nil)
	}
	rcfg := e.runnerConfig()
	rcfg.MaxDeliveries = 3
	rcfg.Logger = log
	r := e.startRelay(httpsink.Config{URL: endpoint, Coordinator: e.coord("relay-a"), Logger: log,
		Header: http.Header{"Authorization": {"Bearer s3cr3t-bearer"}}}, rcfg)
	r.waitPosition(t, last)
	var ready string
	if err := r.Ready(context.Background()); err != nil {
		ready = err.Error()
	}
	shown := logs.String() + ready
	for _, m := range e.deadLetters() {
		for k, vs := range m.Header {
			shown += k + ": " + strings.Join(vs, ",") + "\n"
		}
		shown += string(m.Data)
	}
	for _, s := range secrets {
		if strings.Contains(shown, s) {
			t.Errorf("the secret %q shows in logs, errors or dead letters", s)
		}
	}
	if !strings.Contains(shown, "500") || !strings.Contains(shown, u.Host) {
		t.Errorf("the failures were not reported at all: %s", shown)
	}
	if got := sc.auth["kok"]; got != "Bearer s3cr3t-bearer" {
		t.Errorf("the configured Authorization header was sent as %q", got)
	}
}
