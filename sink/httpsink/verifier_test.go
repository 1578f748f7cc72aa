package httpsink_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/sink/pgsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/testing/pgtest"
)

// store is one of the Verifier's stores.
type store struct {
	name   string
	fences sink.Fencer
	keys   httpsink.Keys
}

// stores builds a fresh store of each kind: memory, a KV bucket (kvsink's
// fence keys, KVKeys) and PostgreSQL (pgsink's fence table,
// PostgresKeys).
func stores(t *testing.T, prefix string) []store {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	js := natstest.Start(t).JetStream(t)
	kvf, err := kvsink.New(ctx, js, kvsink.Config{Bucket: prefix + "-fences", Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	kvk, err := httpsink.NewKVKeys(ctx, js, httpsink.KVKeysConfig{Bucket: prefix + "-keys"})
	if err != nil {
		t.Fatal(err)
	}
	out := []store{
		{"memory", sink.NewMemory(sink.MemoryConfig{Logger: quiet()}), httpsink.NewMemoryKeys(0)},
		{"kv", kvf, kvk},
	}
	pg := pgtest.Start(t)
	cfg, err := pgxpool.ParseConfig(pg.DSN())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 16
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	pcfg := pgsink.Config{DB: db, Prefix: prefix + "_", Logger: quiet()}
	if err := pgsink.CreateSchema(ctx, db, pcfg); err != nil {
		t.Fatal(err)
	}
	pgf, err := pgsink.New(pcfg)
	if err != nil {
		t.Fatal(err)
	}
	pgk, err := httpsink.NewPostgresKeys(ctx, db, httpsink.PostgresKeysConfig{Table: prefix + "_http_keys"})
	if err != nil {
		t.Fatal(err)
	}
	return append(out, store{"postgres", pgf, pgk})
}

// relayed builds a request as a relay of lock scope "hooks/relay" at
// relayEpoch sends the effect keyed key.
func relayed(url string, relayEpoch leasehold.Epoch, acq, key, body string) *http.Request {
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	httpsink.SetStamp(req.Header, leasehold.Stamp{Scope: "orders", Partition: 3, Epoch: 7, Acquisition: "w7", Key: key, Worker: "worker-7"})
	httpsink.SetRelayHeader(req.Header, leasehold.Lease{Scope: "hooks/relay", Epoch: relayEpoch, Acquisition: acq, Holder: fmt.Sprintf("relay-%d", relayEpoch)})
	return req
}

type answer struct {
	status int
	ref    httpsink.Refusal
	header http.Header
}

func do(t testing.TB, req *http.Request) answer {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode, header: resp.Header}
	if resp.Header.Get("Content-Type") == "application/json" {
		if err := json.Unmarshal(body, &a.ref); err != nil {
			t.Fatalf("refusal %s: %v", body, err)
		}
	}
	return a
}

// A stale relay is refused with 409 and a refusal that names what
// superseded it, on every store; a direct request on its own fence; a
// repeat gets the first answer without the handler; a key reused with
// another body 422; a handler's 5xx is not remembered.
func TestVerifierFencesAndDedupes(t *testing.T) {
	t.Parallel()
	for _, s := range stores(t, "vfd") {
		t.Run(s.name, func(t *testing.T) {
			var calls atomic.Int32
			v, err := httpsink.NewVerifier(httpsink.VerifierConfig{Fences: s.fences, Keys: s.keys, Logger: quiet()})
			if err != nil {
				t.Fatal(err)
			}
			fail := atomic.Bool{}
			srv := httptest.NewServer(v.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				st, _ := httpsink.StampFrom(r.Context())
				if fail.Load() {
					w.WriteHeader(http.StatusBadGateway)
					return
				}
				if l, ok := httpsink.RelayFrom(r.Context()); !ok || l.Epoch == 0 || st.Key == "" {
					t.Errorf("the handler got stamp %+v and relay %+v", st, l)
				}
				w.WriteHeader(http.StatusCreated)
			})))
			defer srv.Close()
			if a := do(t, relayed(srv.URL, 10, "r10", "k1", "one")); a.status != http.StatusCreated {
				t.Fatalf("first request: %d", a.status)
			}
			a := do(t, relayed(srv.URL, 10, "r10", "k1", "one"))
			if a.status != http.StatusCreated || a.header.Get(httpsink.HeaderReplayed) != "true" || calls.Load() != 1 {
				t.Errorf("repeat: %d replayed %q, handler calls %d", a.status, a.header.Get(httpsink.HeaderReplayed), calls.Load())
			}
			if a := do(t, relayed(srv.URL, 12, "r12", "k2", "two")); a.status != http.StatusCreated {
				t.Fatalf("a newer relay: %d", a.status)
			}
			a = do(t, relayed(srv.URL, 10, "r10", "k3", "three"))
			want := httpsink.Refusal{Error: httpsink.CodeStaleEpoch, Fence: httpsink.FenceRelay, Scope: "hooks/relay", Epoch: 10, Acquisition: "r10", Max: 12, MaxAcquisition: "r12", Holder: "relay-12"}
			a.ref.Message = ""
			if a.status != http.StatusConflict || a.ref != want {
				t.Errorf("the superseded relay got %d %+v, want 409 %+v", a.status, a.ref, want)
			}
			a = do(t, relayed(srv.URL, 12, "other", "k4", "four"))
			if a.status != http.StatusConflict || a.ref.Error != httpsink.CodeSplitBrain {
				t.Errorf("the relay's epoch from another acquisition got %d %+v", a.status, a.ref)
			}
			if a := do(t, relayed(srv.URL, 12, "r12", "k1", "not one")); a.status != http.StatusUnprocessableEntity || a.ref.Error != httpsink.CodeKeyReused {
				t.Errorf("a key reused with another body got %d %+v", a.status, a.ref)
			}
			// A direct request is judged on its own scope and partition.
			direct := func(e leasehold.Epoch, key string) *http.Request {
				req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(key))
				httpsink.SetStamp(req.Header, leasehold.Stamp{Scope: "orders", Partition: 3, Epoch: e, Acquisition: fmt.Sprintf("w%d", e), Key: key, Worker: fmt.Sprintf("worker-%d", e)})
				return req
			}
			// (The handler checks for a relay: direct requests are
			// counted, not checked.)
			before := calls.Load()
			fail.Store(true)
			if a := do(t, direct(20, "d1")); a.status != http.StatusBadGateway {
				t.Fatalf("direct: %d", a.status)
			}
			if a := do(t, direct(20, "d1")); a.status != http.StatusBadGateway || calls.Load() != before+2 {
				t.Errorf("a 5xx was remembered: %d, handler calls %d", a.status, calls.Load()-before)
			}
			fail.Store(false)
			a = do(t, direct(19, "d2"))
			if a.status != http.StatusConflict || a.ref.Fence != httpsink.FenceEffect || a.ref.Scope != "orders" || a.ref.Partition != 3 || a.ref.Max != 20 || a.ref.Holder != "worker-20" {
				t.Errorf("a stale direct request got %d %+v", a.status, a.ref)
			}
		})
	}
}

// Untrusted input is parsed strictly: each malformed request is refused
// with the answer its fault calls for, and reaches no handler.
func TestVerifierRefusesMalformed(t *testing.T) {
	t.Parallel()
	v, err := httpsink.NewVerifier(httpsink.VerifierConfig{MaxBodyBytes: 64, MaxHeaders: 24, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(v.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Errorf("a malformed request reached the handler: %v", r.Header)
	})))
	defer srv.Close()
	good := func() *http.Request { return relayed(srv.URL, 5, "r5", "k1", "body") }
	for _, tc := range []struct {
		name   string
		edit   func(r *http.Request)
		status int
		code   string
	}{
		{"no stamp", func(r *http.Request) {
			for k := range r.Header {
				if strings.HasPrefix(k, "Leasehold-") {
					r.Header.Del(k)
				}
			}
		}, 400, httpsink.CodeMissingStamp},
		{"padded epoch", func(r *http.Request) { r.Header.Set(leasehold.HeaderEpoch, "007") }, 400, httpsink.CodeBadStamp},
		{"signed epoch", func(r *http.Request) { r.Header.Set(leasehold.HeaderEpoch, "+7") }, 400, httpsink.CodeBadStamp},
		{"two epochs", func(r *http.Request) { r.Header.Add(leasehold.HeaderEpoch, "8") }, 400, httpsink.CodeBadStamp},
		{"no partition", func(r *http.Request) { r.Header.Del(leasehold.HeaderPartition) }, 400, httpsink.CodeBadStamp},
		{"bad relay epoch", func(r *http.Request) { r.Header.Set(httpsink.HeaderRelayEpoch, "0") }, 400, httpsink.CodeBadStamp},
		{"relay epoch twice", func(r *http.Request) { r.Header.Add(httpsink.HeaderRelayEpoch, "5") }, 400, httpsink.CodeBadStamp},
		{"part of a relay stamp", func(r *http.Request) { r.Header.Del(httpsink.HeaderRelayAcquisition) }, 400, httpsink.CodeBadStamp},
		{"relay acquisition with a space", func(r *http.Request) { r.Header.Set(httpsink.HeaderRelayAcquisition, "r 5") }, 400, httpsink.CodeBadStamp},
		{"no key", func(r *http.Request) { r.Header.Del(httpsink.HeaderIdempotencyKey) }, 400, httpsink.CodeMissingKey},
		{"unquoted key", func(r *http.Request) { r.Header.Set(httpsink.HeaderIdempotencyKey, "orders k1") }, 400, httpsink.CodeBadKey},
		{"key of another effect", func(r *http.Request) { r.Header.Set(httpsink.HeaderIdempotencyKey, `"orders k2"`) }, 400, httpsink.CodeBadKey},
		{"key with parameters", func(r *http.Request) { r.Header.Set(httpsink.HeaderIdempotencyKey, `"orders k1";a=1`) }, 400, httpsink.CodeBadKey},
		{"two keys", func(r *http.Request) { r.Header.Add(httpsink.HeaderIdempotencyKey, `"orders k1"`) }, 400, httpsink.CodeBadKey},
		{"body too large", func(r *http.Request) {
			b := strings.Repeat("x", 65)
			r.Body, r.ContentLength = io.NopCloser(strings.NewReader(b)), int64(len(b))
		}, 413, httpsink.CodeTooLarge},
		{"too many headers", func(r *http.Request) {
			for i := range 20 {
				r.Header.Set(fmt.Sprintf("X-Pad-%d", i), "x")
			}
		}, 431, httpsink.CodeTooManyHeaders},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := good()
			tc.edit(req)
			if a := do(t, req); a.status != tc.status || a.ref.Error != tc.code {
				t.Errorf("got %d %q (%s), want %d %q", a.status, a.ref.Error, a.ref.Message, tc.status, tc.code)
			}
		})
	}
	if st := v.Stats(); st.Passed != 0 || st.Bad == 0 {
		t.Errorf("stats %+v", st)
	}
	// Unstamped requests pass when configured to.
	pass, _ := httpsink.NewVerifier(httpsink.VerifierConfig{Unstamped: httpsink.PassUnstamped, Logger: quiet()})
	var passed atomic.Bool
	psrv := httptest.NewServer(pass.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { passed.Store(true) })))
	defer psrv.Close()
	req, _ := http.NewRequest(http.MethodPost, psrv.URL, nil)
	if a := do(t, req); a.status != http.StatusOK || !passed.Load() {
		t.Errorf("an unstamped request with PassUnstamped: %d, passed %v", a.status, passed.Load())
	}
}

// The fence's check and raise are one atomic step on every store: many
// goroutines send requests of random relay epochs for one fence at once,
// and no request is admitted once a request of a higher epoch was
// admitted and answered before it began (a fence never goes back), and
// the fence ends at the highest epoch admitted.
func TestVerifierFenceAtomicity(t *testing.T) {
	t.Parallel()
	for _, s := range stores(t, "vatom") {
		t.Run(s.name, func(t *testing.T) {
			if bad := fenceRace(t, s.fences, s.keys); len(bad) > 0 {
				t.Errorf("%d violations, the first: %s", len(bad), bad[0])
			}
		})
	}
}

// The check above finds a store that checks and then raises in two steps.
func TestFenceRaceFindsCheckThenRaise(t *testing.T) {
	t.Parallel()
	for round := range 20 {
		if bad := fenceRace(t, &checkThenRaise{f: map[leasehold.FenceID]leasehold.FenceState{}}, httpsink.NewMemoryKeys(0)); len(bad) > 0 {
			t.Logf("round %d: found %d violations, the first: %s", round, len(bad), bad[0])
			return
		}
	}
	t.Fatal("a store that checks, then raises, passed 20 rounds")
}

// fenceRace runs the concurrent requests and returns the violations.
func fenceRace(t *testing.T, fences sink.Fencer, keys httpsink.Keys) []string {
	t.Helper()
	v, err := httpsink.NewVerifier(httpsink.VerifierConfig{Fences: fences, Keys: keys, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(v.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})))
	defer srv.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	defer client.CloseIdleConnections()
	type result struct {
		epoch      leasehold.Epoch
		admitted   bool
		start, end time.Time
	}
	const goroutines, each = 24, 12
	var (
		mu      sync.Mutex
		results []result
		wg      sync.WaitGroup
		seq     atomic.Int64
	)
	scope := fmt.Sprintf("hooks/race-%d", rand.Int64())
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(g), 7))
			for range each {
				e := leasehold.Epoch(1 + rnd.IntN(60))
				key := fmt.Sprintf("k%d", seq.Add(1))
				req := relayed(srv.URL, e, fmt.Sprintf("r%d", e), key, key)
				req.Header.Set(httpsink.HeaderRelayScope, scope)
				start := time.Now()
				resp, err := client.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				end := time.Now()
				if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusConflict {
					t.Errorf("epoch %d: %d", e, resp.StatusCode)
				}
				mu.Lock()
				results = append(results, result{epoch: e, admitted: resp.StatusCode == http.StatusOK, start: start, end: end})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	var bad []string
	var top leasehold.Epoch
	for _, a := range results {
		if !a.admitted {
			continue
		}
		top = max(top, a.epoch)
		for _, b := range results {
			if b.admitted && b.end.Before(a.start) && b.epoch > a.epoch {
				bad = append(bad, fmt.Sprintf("epoch %d was admitted after epoch %d had been admitted and answered", a.epoch, b.epoch))
			}
		}
	}
	f, err := fences.Fence(context.Background(), leasehold.FenceID{Scope: scope})
	if err != nil {
		t.Fatal(err)
	}
	if f.Epoch != top {
		bad = append(bad, fmt.Sprintf("the fence ended at %d, the highest epoch admitted is %d", f.Epoch, top))
	}
	return bad
}

// checkThenRaise is a broken fence store: it reads, then writes, with a
// moment between.
type checkThenRaise struct {
	mu sync.Mutex
	f  map[leasehold.FenceID]leasehold.FenceState
}

func (c *checkThenRaise) Advance(ctx context.Context, l leasehold.Lease) error {
	c.mu.Lock()
	cur := c.f[l.Fence()]
	c.mu.Unlock()
	v, raise := leasehold.Judge(cur, l.Stamp("x"))
	if v != leasehold.Admit {
		return leasehold.Refusal(cur, l.Stamp("x"), v)
	}
	time.Sleep(time.Millisecond) // the moment between
	if raise {
		c.mu.Lock()
		c.f[l.Fence()] = leasehold.FenceState{Epoch: l.Epoch, Acquisition: l.Acquisition, Holder: l.Holder}
		c.mu.Unlock()
	}
	return nil
}

func (c *checkThenRaise) Fence(ctx context.Context, id leasehold.FenceID) (leasehold.FenceState, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.f[id], nil
}

// Concurrent requests with one key run the handler once on every store:
// the others are told the first is in progress, or get its answer.
func TestVerifierDedupeAtomicity(t *testing.T) {
	t.Parallel()
	for _, s := range stores(t, "vdup") {
		t.Run(s.name, func(t *testing.T) {
			v, err := httpsink.NewVerifier(httpsink.VerifierConfig{Fences: s.fences, Keys: s.keys, Logger: quiet()})
			if err != nil {
				t.Fatal(err)
			}
			var calls, answered atomic.Int32
			enough := make(chan struct{})
			srv := httptest.NewServer(v.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				// The first request holds its key until eight others were
				// answered meanwhile.
				select {
				case <-enough:
				case <-time.After(30 * time.Second):
					t.Error("no other request was answered while the first held its key")
				}
				w.WriteHeader(http.StatusAccepted)
			})))
			defer srv.Close()
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
			defer client.CloseIdleConnections()
			var wg sync.WaitGroup
			var mu sync.Mutex
			answers := map[string]int{}
			for range 32 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					resp, err := client.Do(relayed(srv.URL, 3, "r3", "charge-1", "42 EUR"))
					if err != nil {
						t.Error(err)
						return
					}
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					what := fmt.Sprint(resp.StatusCode)
					if resp.Header.Get(httpsink.HeaderReplayed) == "true" {
						what += " replayed"
					}
					if bytes.Contains(body, []byte(httpsink.CodeInProgress)) {
						what += " in progress"
					}
					mu.Lock()
					answers[what]++
					mu.Unlock()
					if answered.Add(1) == 8 {
						close(enough)
					}
				}()
			}
			wg.Wait()
			if calls.Load() != 1 {
				t.Errorf("the handler ran %d times for one key, want once: %v", calls.Load(), answers)
			}
			for what := range answers {
				if what != "202" && what != "202 replayed" && what != "409 in progress" {
					t.Errorf("answer %q", what)
				}
			}
			t.Logf("answers: %v", answers)
		})
	}
}
