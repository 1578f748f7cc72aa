package httpsink_test

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/httpsink"
)

// countingTransport counts the requests it sends, by effect key, and can
// hold one back.
type countingTransport struct {
	base http.RoundTripper

	mu   sync.Mutex
	sent map[string]int
	// hold, when set, is called before a request is sent; it may block.
	hold func(r *http.Request) *http.Request
	// answers records the status of each response, by effect key.
	answers map[string][]int
	bodies  map[string][]string
}

func newTransport() *countingTransport {
	return &countingTransport{base: http.DefaultTransport.(*http.Transport).Clone(), sent: map[string]int{}, answers: map[string][]int{}, bodies: map[string][]string{}}
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	key := r.Header.Get(leasehold.HeaderKey)
	c.mu.Lock()
	hold := c.hold
	c.mu.Unlock()
	if hold != nil {
		r = hold(r)
	}
	c.mu.Lock()
	c.sent[key]++
	c.mu.Unlock()
	resp, err := c.base.RoundTrip(r)
	if err == nil {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		resp.Body = io.NopCloser(strings.NewReader(string(body)))
		c.mu.Lock()
		c.answers[key] = append(c.answers[key], resp.StatusCode)
		c.bodies[key] = append(c.bodies[key], string(body))
		c.mu.Unlock()
	}
	return resp, err
}

func (c *countingTransport) count(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sent[key]
}

func (c *countingTransport) close() { c.base.(*http.Transport).CloseIdleConnections() }

// A zombie worker's effect, published into the effect log behind its
// successor's barrier, never becomes a request: the runner refuses it
// before the relay sees it. Its earlier effect, published before the
// barrier, is delivered, and so is the successor's.
func TestZombieWebhookNeverSent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "zombiehook")
	rc := newReceiver(t, httpsink.VerifierConfig{RequireRelay: true})
	tr := newTransport()
	defer tr.close()
	e.barrier(1)
	e.publish("hook", e.stamp(1, "k1"), []byte(`{"n":1}`), nil)
	e.barrier(2)
	zombie := e.publish("hook", e.stamp(1, "k2"), []byte(`{"n":2, "by":"zombie"}`), nil)
	last := e.publish("hook", e.stamp(2, "k3"), []byte(`{"n":3}`), nil)
	var mu sync.Mutex
	decided := map[uint64]sink.Outcome{}
	rcfg := e.runnerConfig()
	rcfg.Observer = sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
		mu.Lock()
		decided[d.Position] = d.Outcome
		mu.Unlock()
	})
	r := e.startRelay(httpsink.Config{URL: rc.URL, Coordinator: e.coord("relay-a"), Transport: tr}, rcfg)
	r.waitPosition(t, last)
	rc.waitCalls(t, map[string]int{"k1": 1, "k3": 1})
	if n := tr.count("k2"); n != 0 {
		t.Errorf("the zombie's effect was sent %d times, want never", n)
	}
	if n := rc.count("k2"); n != 0 {
		t.Errorf("the zombie's effect reached the receiver's handler %d times", n)
	}
	mu.Lock()
	if decided[zombie] != sink.Stale {
		t.Errorf("the zombie's effect was decided %v, want stale", decided[zombie])
	}
	mu.Unlock()
}

// A relay killed while its request is at the receiver leaves the effect
// unsaved; the relay that takes over sends it again with the same
// Idempotency-Key, and the receiver's verifier answers from its key store:
// the handler ran once.
func TestKilledRelayRedeliversSameKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "killed")
	rc := newReceiver(t, httpsink.VerifierConfig{})
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	rc.answer = func(w http.ResponseWriter, r *http.Request, st leasehold.Stamp, n int) bool {
		if st.Key == "k1" && n == 1 {
			once.Do(func() { close(entered) })
			<-release // the handler finishes after the relay is gone
		}
		return false
	}
	e.barrier(1)
	seq := e.publish("hook", e.stamp(1, "k1"), []byte(`{"charge":42}`), nil)
	a := e.startRelay(httpsink.Config{URL: rc.URL, Coordinator: e.coord("relay-a")}, e.runnerConfig())
	select {
	case <-entered:
	case <-ctxFor(t, time.Minute).Done():
		t.Fatal("the first request did not reach the handler")
	}
	if err := a.stop(); err != nil {
		t.Fatalf("relay a: %v", err)
	}
	close(release)
	b := e.startRelay(httpsink.Config{URL: rc.URL, Coordinator: e.coord("relay-b")}, e.runnerConfig())
	b.waitPosition(t, seq)
	if n := rc.count("k1"); n != 1 {
		t.Errorf("the handler ran %d times for k1, want once", n)
	}
	rc.mu.Lock()
	keys := rc.keys["k1"]
	rc.mu.Unlock()
	if len(keys) != 1 {
		t.Errorf("the requests for k1 carried %d Idempotency-Keys, want one: %v", len(keys), keys)
	}
	for k := range keys {
		if want := httpsink.IdempotencyKey(e.stamp(1, "k1")); k != want {
			t.Errorf("Idempotency-Key %s, want %s", k, want)
		}
	}
	if st := rc.v.Stats(); st.Replayed+st.InProgress == 0 {
		t.Errorf("the verifier answered no repeat from its key store: %+v", st)
	}
}

// Two relays of one lock: relay a is paused (it stops renewing its lock)
// with a request on its way; its lock expires and relay b takes over at a
// higher epoch and delivers the effect; when a wakes, its request reaches
// the receiver with a's relay epoch, and the verifier refuses it with 409,
// naming b's epoch and holder. The handler ran once, for b.
func TestPausedRelayRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "paused")
	rc := newReceiver(t, httpsink.VerifierConfig{RequireRelay: true})
	ca, cb := e.coord("relay-a"), e.coord("relay-b")
	held, wake := make(chan struct{}), make(chan struct{})
	var once sync.Once
	tr := newTransport()
	defer tr.close()
	tr.hold = func(r *http.Request) *http.Request {
		if r.Header.Get(leasehold.HeaderKey) != "k1" {
			return r
		}
		once.Do(func() { close(held) })
		<-wake
		// A paused process does not see its lease end: its request goes
		// out as it was built.
		return r.WithContext(context.WithoutCancel(r.Context()))
	}
	e.barrier(1)
	seq := e.publish("hook", e.stamp(1, "k1"), []byte(`{"n":1}`), nil)
	a := e.startRelay(httpsink.Config{URL: rc.URL, Coordinator: ca, Transport: tr, Lock: "hooks", LockOptions: manualRenew()}, e.runnerConfig())
	// Relay a renews its lock until it is paused mid-request.
	ctx := ctxFor(t, time.Minute)
	renewing := make(chan struct{})
	go func() {
		defer close(renewing)
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-held:
				return
			case <-ctx.Done():
				return
			case <-tick.C:
				if l := a.Lease(); l != nil {
					_ = l.Renew(ctx)
				}
			}
		}
	}()
	select {
	case <-held:
	case <-ctx.Done():
		t.Fatal("relay a never sent its request")
	}
	<-renewing
	aEpoch := a.Lease()
	if aEpoch == nil {
		t.Fatal("relay a holds no lock while its request is on its way")
	}
	aInfo := aEpoch.Info()
	b := e.startRelay(httpsink.Config{URL: rc.URL, Coordinator: cb, Lock: "hooks"}, e.runnerConfig())
	b.waitPosition(t, seq)
	rc.waitCalls(t, map[string]int{"k1": 1})
	rc.mu.Lock()
	by := rc.relays["k1"]
	rc.mu.Unlock()
	if len(by) != 1 || by[0].Epoch <= aInfo.Epoch || by[0].Holder != "relay-b" {
		t.Fatalf("k1 reached the handler through %+v, want relay-b above relay a's epoch %d", by, aInfo.Epoch)
	}
	close(wake)
	eventually(t, "relay a's late request answered", func() bool {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		return len(tr.answers["k1"]) > 0
	})
	tr.mu.Lock()
	status, body := tr.answers["k1"][0], tr.bodies["k1"][0]
	tr.mu.Unlock()
	if status != http.StatusConflict {
		t.Fatalf("relay a's late request got %d, want 409: %s", status, body)
	}
	var ref httpsink.Refusal
	if err := json.Unmarshal([]byte(body), &ref); err != nil {
		t.Fatalf("the 409's body is not a refusal: %v: %s", err, body)
	}
	if ref.Error != httpsink.CodeStaleEpoch || ref.Fence != httpsink.FenceRelay || ref.Epoch != uint64(aInfo.Epoch) ||
		ref.Max != uint64(by[0].Epoch) || ref.Holder != "relay-b" || ref.Scope != aInfo.Scope {
		t.Errorf("refusal %+v, want stale_epoch on the relay fence %s: epoch %d below %d held by relay-b", ref, aInfo.Scope, aInfo.Epoch, by[0].Epoch)
	}
	if n := rc.count("k1"); n != 1 {
		t.Errorf("the handler ran %d times for k1, want once", n)
	}
	_ = a.stop()
}

// A receiver that refuses connections for a while (down, then started)
// loses nothing: the relay retries with the runner's backoff, fails
// Ready meanwhile saying why, and delivers everything once it is up; no
// effect is dead-lettered.
func TestReceiverDownLosesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "down")
	down := newDownReceiver(t)
	rcfg := e.runnerConfig()
	rcfg.MaxDeliveries = 1000 // the bound: 1000 tries of up to 20 ms
	e.barrier(1)
	var last uint64
	for i := range 5 {
		last = e.publish("hook", e.stamp(1, keyN(i)), []byte(`{}`), nil)
	}
	r := e.startRelay(httpsink.Config{URL: down.url, Coordinator: e.coord("relay-a")}, rcfg)
	// The receiver stays down until the relay has tried it many times,
	// each try counted toward MaxDeliveries.
	var ready error
	tries := regexp.MustCompile(`\((\d+) tries\)`)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the relay's last Ready: %v", ready)
		}
	})
	eventually(t, "Ready reports the receiver down after 50 tries", func() bool {
		ready = r.Ready(context.Background())
		if ready == nil || !strings.Contains(ready.Error(), "connection refused") {
			return false
		}
		m := tries.FindStringSubmatch(ready.Error())
		n, _ := strconv.Atoi(m[1])
		return n >= 50
	})
	t.Logf("while down: %v", ready)
	rc := down.start(t, httpsink.VerifierConfig{})
	r.waitPosition(t, last)
	want := map[string]int{}
	for i := range 5 {
		want[keyN(i)] = 1
	}
	rc.waitCalls(t, want)
	if got := rc.snapshot(); len(got) != 5 {
		t.Errorf("receiver saw %v", got)
	}
	if dl := e.deadLetters(); len(dl) != 0 {
		t.Errorf("%d effects were dead-lettered, want none", len(dl))
	}
	eventually(t, "Ready once the receiver is up", func() bool { return r.Ready(context.Background()) == nil })
}

func keyN(i int) string { return "k" + string(rune('a'+i)) }

// An effect can name no host: a route header whose value is a URL, data
// that is a URL, headers of the effect's own such as Host: the request
// goes where configuration says, or nowhere (dead-lettered at once).
func TestEffectNamingAnotherHostReachesNobody(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "nohost")
	rc := newReceiver(t, httpsink.VerifierConfig{})
	billing := newReceiver(t, httpsink.VerifierConfig{})
	evil := newReceiver(t, httpsink.VerifierConfig{Unstamped: httpsink.PassUnstamped})
	e.barrier(1)
	e.publish("hook", e.stamp(1, "by-header-url"), []byte(`{}`), map[string][]string{"Webhook-Endpoint": {evil.URL}})
	e.publish("hook", e.stamp(1, "by-header-host"), []byte(`{}`), map[string][]string{"Webhook-Endpoint": {strings.TrimPrefix(evil.URL, "http://")}})
	e.publish("hook", e.stamp(1, "by-header-name"), []byte(`{}`), map[string][]string{"Webhook-Endpoint": {"billing"}})
	e.publish("hook", e.stamp(1, "by-data"), []byte(evil.URL), map[string][]string{"Host": {strings.TrimPrefix(evil.URL, "http://")}, "Location": {evil.URL}, "X-Forwarded-Host": {evil.URL}})
	last := e.publish("hook", e.stamp(1, "by-subject"), []byte(`{}`), nil)
	r := e.startRelay(httpsink.Config{URL: rc.URL, Endpoints: map[string]string{"billing": billing.URL}, RouteHeader: "Webhook-Endpoint", Coordinator: e.coord("relay-a")}, e.runnerConfig())
	r.waitPosition(t, last)
	if got := evil.snapshot(); len(got) != 0 || evil.v.Stats().Unstamped != 0 || evil.v.Stats().Passed != 0 {
		t.Fatalf("the host effects named was reached: %v %+v", got, evil.v.Stats())
	}
	rc.waitCalls(t, map[string]int{"by-data": 1, "by-subject": 1})
	billing.waitCalls(t, map[string]int{"by-header-name": 1})
	dl := e.deadLetters()
	if len(dl) != 2 {
		t.Fatalf("%d dead letters, want the two effects that named a host", len(dl))
	}
	for _, m := range dl {
		if got := m.Header.Get("Leasehold-Sink-Tries"); got != "1" {
			t.Errorf("dead letter %s after %s tries, want at once", m.Header.Get(leasehold.HeaderKey), got)
		}
		if msg := m.Header.Get("Leasehold-Sink-Error"); !strings.Contains(msg, "names no configured endpoint") {
			t.Errorf("dead letter's error %q does not say why", msg)
		}
	}
}

func manualRenew() []coordinator.AcquireOption {
	return []coordinator.AcquireOption{coordinator.ManualRenew()}
}

// downReceiver is a receiver's address on which nothing listens yet:
// connections are refused until start.
type downReceiver struct {
	addr, url string
	listen    func() (net.Listener, error)
}

func newDownReceiver(t *testing.T) *downReceiver {
	t.Helper()
	addr, listen := boundPort(t)
	return &downReceiver{addr: addr, url: "http://" + addr + "/hooks", listen: listen}
}

// start serves a receiver on the address.
func (d *downReceiver) start(t *testing.T, vc httpsink.VerifierConfig) *receiver {
	t.Helper()
	rc := newReceiver(t, vc) // its own server is not used
	ln, err := d.listen()
	if err != nil {
		t.Fatalf("listen on %s: %v", d.addr, err)
	}
	srv := &http.Server{Handler: rc.handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return rc
}
