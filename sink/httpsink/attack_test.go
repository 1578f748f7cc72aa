package httpsink_test

import (
	"context"
	"errors"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/sink/kvsink"
)

// Attacks on a receiver's Verifier from outside: plain HTTP requests from
// anyone who can reach the receiver, beside a real relay delivering the
// effect log under its lock in the lease bucket. The forger can read what
// the relay sends (its scope, epoch, acquisition) from the lease bucket or
// the wire, and the keys of effects to come are predictable.

// forged builds a relayed request with a relay stamp of the forger's
// choosing, for an effect keyed key of the env's scope.
func forged(url string, relay leasehold.Lease, e *env, key, body string) *http.Request {
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	httpsink.SetStamp(req.Header, e.stamp(1, key))
	httpsink.SetRelayHeader(req.Header, relay)
	return req
}

// handOverHooks has relay-a deliver k1 under the lock "hooks", stops it,
// and has relay-b, which takes the lock then, deliver k2: la and lb are
// the leases the two relays sent their requests under.
func handOverHooks(t *testing.T, e *env, rc *receiver) (la, lb leasehold.Lease, rb *relay) {
	t.Helper()
	e.barrier(1)
	e.publish("hook", e.stamp(1, "k1"), []byte(`{"n":1}`), nil)
	ra := e.startRelay(httpsink.Config{URL: rc.URL, Coordinator: e.coord("relay-a"), Lock: "hooks"}, e.runnerConfig())
	la = firstRelay(t, rc, "k1")
	_ = ra.stop()
	e.publish("hook", e.stamp(1, "k2"), []byte(`{"n":2}`), nil)
	rb = e.startRelay(httpsink.Config{URL: rc.URL, Coordinator: e.coord("relay-b"), Lock: "hooks"}, e.runnerConfig())
	lb = firstRelay(t, rc, "k2")
	return la, lb, rb
}

// firstRelay waits until key reached the receiver's handler through a
// relay, and returns the relay's lease as the request carried it.
func firstRelay(t *testing.T, rc *receiver, key string) leasehold.Lease {
	t.Helper()
	rc.waitCalls(t, map[string]int{key: 1})
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if len(rc.relays[key]) == 0 {
		t.Fatalf("%s reached the handler without a relay stamp", key)
	}
	return rc.relays[key][0]
}

// With the fences in a store that verifies epochs against the lease
// bucket (kvsink given the bucket), a forged request with the relay's
// scope and an epoch far above any the bucket issued is refused (403),
// and neither it nor a forged acquisition at the relay's own epoch, nor the
// relay's epoch before the lock changed hands, stops the live relay: the
// next effect is delivered once.
func TestAttackVerifierForgedRelayEpochVerifiedStore(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "atkrelayv")
	fences, err := kvsink.New(ctxFor(t, time.Minute), e.js, kvsink.Config{Bucket: "atkrelayv-receiver", Verifier: e.bucket, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	rc := newReceiver(t, httpsink.VerifierConfig{RequireRelay: true, Fences: fences})
	la, lb, rb := handOverHooks(t, e, rc)
	if lb.Epoch <= la.Epoch {
		t.Fatalf("relay-b's epoch %d is not above relay-a's %d", lb.Epoch, la.Epoch)
	}
	for _, tc := range []struct {
		name   string
		relay  leasehold.Lease
		status int
	}{
		{"an epoch above any issued", leasehold.Lease{Scope: lb.Scope, Epoch: leasehold.Epoch(math.MaxInt64 / 2), Acquisition: "forged", Holder: "relay-x"}, http.StatusForbidden},
		{"the live epoch, another acquisition", leasehold.Lease{Scope: lb.Scope, Epoch: lb.Epoch, Acquisition: "forged", Holder: "relay-x"}, http.StatusConflict},
		{"the epoch before the lock changed hands", la, http.StatusConflict},
		{"the live epoch just above, unissued", leasehold.Lease{Scope: lb.Scope, Epoch: lb.Epoch + 1, Acquisition: lb.Acquisition, Holder: "relay-x"}, http.StatusForbidden},
	} {
		a := do(t, forged(rc.URL, tc.relay, e, "forged-"+strings.ReplaceAll(tc.name, " ", "-"), "evil"))
		if a.status != tc.status {
			t.Errorf("forged relay stamp (%s): answered %d %+v, want %d", tc.name, a.status, a.ref, tc.status)
		}
	}
	last := e.publish("hook", e.stamp(1, "k3"), []byte(`{"n":3}`), nil)
	rb.waitPosition(t, last)
	rc.waitCalls(t, map[string]int{"k3": 1})
	for k, n := range rc.snapshot() {
		if strings.HasPrefix(k, "forged") {
			t.Errorf("a forged request reached the handler %d times (%s)", n, k)
		} else if n != 1 {
			t.Errorf("%s reached the handler %d times, want once", k, n)
		}
	}
	if got := rc.relays["k3"]; len(got) != 1 || got[0].Holder != "relay-b" {
		t.Errorf("k3 went through %+v, want relay-b", got)
	}
}

// With the Verifier's default fence store (memory, which verifies
// nothing against the lease bucket), one forged request with the relay's
// scope and an epoch far above any the bucket issues fences the live relay
// out of that receiver. What must hold then: the relay says so and stops
// (RunSink fails naming the receivers' stores), and the effect it could
// not deliver is neither dead-lettered nor dropped: it stays in the log
// for a relay to deliver once the receiver's store is fixed.
func TestAttackVerifierForgedRelayEpochDefaultStoreIsVisible(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "atkrelayd")
	rc := newReceiver(t, httpsink.VerifierConfig{RequireRelay: true})
	e.barrier(1)
	e.publish("hook", e.stamp(1, "k1"), []byte(`{"n":1}`), nil)
	ra := e.startRelay(httpsink.Config{URL: rc.URL, Coordinator: e.coord("relay-a"), Lock: "hooks"}, e.runnerConfig())
	la := firstRelay(t, rc, "k1")
	a := do(t, forged(rc.URL, leasehold.Lease{Scope: la.Scope, Epoch: leasehold.Epoch(math.MaxInt64 / 2), Acquisition: "forged", Holder: "relay-x"}, e, "forged", "evil"))
	if a.status/100 != 2 {
		t.Fatalf("the forged request was answered %d: the default store refuses it, so this attack no longer applies", a.status)
	}
	e.publish("hook", e.stamp(1, "k2"), []byte(`{"n":2}`), nil)
	select {
	case err := <-ra.done:
		ra.done <- err // for the cleanup
		if err == nil || !errors.Is(err, httpsink.ErrRelaySuperseded) || !strings.Contains(err.Error(), "stores") {
			t.Errorf("the relay ended with %v; want an error matching ErrRelaySuperseded that names the receivers' stores", err)
		}
		t.Logf("the relay fenced out by one forged request says: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatalf("the relay fenced out of its receiver did not stop within 15 s (ready: %v)", ra.Ready(context.Background()))
	}
	if n := rc.count("k2"); n != 0 {
		t.Errorf("k2 reached the handler %d times through a relay the receiver refuses", n)
	}
	for _, m := range e.deadLetters() {
		if m.Header.Get(leasehold.HeaderKey) == "k2" {
			t.Errorf("k2 was dead-lettered while its relay was refused: %v", m.Header)
		}
	}
}

// A forger who knows the key of an effect still to come sends a request
// under it with another body, but with a relay epoch below the receiver's
// fence (the relay's before the lock changed hands), or with a request
// the Verifier refuses for its shape: none of them may claim the key, so
// the relay's own request under it later runs the handler with its own
// body. A request refused for its shape must not raise the fence either.
func TestAttackVerifierRefusedRequestsClaimNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "atkclaim")
	rc := newReceiver(t, httpsink.VerifierConfig{RequireRelay: true, MaxBodyBytes: 256})
	la, lb, rb := handOverHooks(t, e, rc)
	high := leasehold.Lease{Scope: lb.Scope, Epoch: lb.Epoch + 1000, Acquisition: "forged", Holder: "relay-x"}
	attempts := []struct {
		name   string
		req    *http.Request
		status int
	}{
		{"the superseded relay's epoch", forged(rc.URL, la, e, "k3", "evil"), http.StatusConflict},
	}
	shape := func(name string, edit func(r *http.Request), status int) {
		r := forged(rc.URL, high, e, "k3", "evil")
		edit(r)
		attempts = append(attempts, struct {
			name   string
			req    *http.Request
			status int
		}{name, r, status})
	}
	shape("a key of another effect", func(r *http.Request) { r.Header.Set(httpsink.HeaderIdempotencyKey, `"atkclaim k4"`) }, http.StatusBadRequest)
	shape("two keys", func(r *http.Request) { r.Header.Add(httpsink.HeaderIdempotencyKey, `"atkclaim k3"`) }, http.StatusBadRequest)
	shape("a body too large", func(r *http.Request) {
		b := strings.Repeat("x", 257)
		r.Body, r.ContentLength = http.NoBody, 0
		r2, _ := http.NewRequest(http.MethodPost, r.URL.String(), strings.NewReader(b))
		r2.Header = r.Header
		*r = *r2
	}, http.StatusRequestEntityTooLarge)
	shape("two relay epochs", func(r *http.Request) { r.Header.Add(httpsink.HeaderRelayEpoch, lb.Epoch.String()) }, http.StatusBadRequest)
	shape("a relay worker alone", func(r *http.Request) {
		r.Header.Del(httpsink.HeaderRelayScope)
		r.Header.Del(httpsink.HeaderRelayEpoch)
		r.Header.Del(httpsink.HeaderRelayAcquisition)
	}, http.StatusBadRequest)
	shape("the stamp's epoch twice", func(r *http.Request) { r.Header.Add(leasehold.HeaderEpoch, "2") }, http.StatusBadRequest)
	shape("a lower-case duplicate of the key header", func(r *http.Request) {
		r.Header["idempotency-key"] = []string{`"atkclaim k9"`}
	}, http.StatusBadRequest)
	for _, at := range attempts {
		if a := do(t, at.req); a.status != at.status {
			t.Errorf("forged request (%s): answered %d %+v, want %d", at.name, a.status, a.ref, at.status)
		}
	}
	// The relay's own request for k3, at relay-b's epoch: the fence was
	// not raised by the refused requests, and the key is free.
	last := e.publish("hook", e.stamp(1, "k3"), []byte(`{"n":3}`), nil)
	rb.waitPosition(t, last)
	rc.waitCalls(t, map[string]int{"k3": 1})
	if got := rc.relays["k3"]; len(got) != 1 || got[0].Holder != "relay-b" {
		t.Errorf("k3 went through %+v, want relay-b once", got)
	}
	if n := rc.count("k3"); n != 1 {
		t.Errorf("k3 reached the handler %d times", n)
	}
	if st := rc.v.Stats(); st.KeyReused != 0 {
		t.Errorf("the relay's own request was refused as a key reused: stats %+v", st)
	}
	for _, m := range e.deadLetters() {
		t.Errorf("dead-lettered: %s (%s)", m.Header.Get(leasehold.HeaderKey), m.Header.Get("Leasehold-Sink-Error"))
	}
}
