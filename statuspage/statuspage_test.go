package statuspage

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/testing/natstest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

func encode(t *testing.T, e Event) []byte {
	t.Helper()
	b, err := json.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Events come from anyone allowed to publish on the stream: each must be
// one leasehold would write, on the subject of its kind.
func TestDecodeEventRefusesWhatLeaseholdWouldNotWrite(t *testing.T) {
	t.Parallel()
	good := Event{Kind: KindRefused, Time: time.Now(), Source: "kv", Scope: "orders", Partition: 3, Worker: "w1", Epoch: 5, Max: 9, Outcome: "stale", Key: "k"}
	refused := EventSubject("leasehold", KindRefused)
	if _, err := decodeEvent("leasehold", refused, encode(t, good)); err != nil {
		t.Fatalf("a good event: %v", err)
	}
	with := func(f func(*Event)) []byte { e := good; f(&e); return encode(t, e) }
	for name, c := range map[string]struct {
		subject string
		data    []byte
	}{
		"kind on the wrong subject": {EventSubject("leasehold", KindAcquired), encode(t, good)},
		"another prefix":            {EventSubject("other", KindRefused), encode(t, good)},
		"unknown kind":              {refused, with(func(e *Event) { e.Kind = "refused<script>" })},
		"no time":                   {refused, with(func(e *Event) { e.Time = time.Time{} })},
		"no scope":                  {refused, with(func(e *Event) { e.Scope = "" })},
		"no outcome":                {refused, with(func(e *Event) { e.Outcome = "" })},
		"control characters":        {refused, with(func(e *Event) { e.Worker = "w1\x1b[2J" })},
		"a long string":             {refused, with(func(e *Event) { e.Key = strings.Repeat("k", maxText+1) })},
		"unknown field":             {refused, []byte(`{"kind":"refused","time":"2026-01-01T00:00:00Z","scope":"s","outcome":"stale","html":"<b>"}`)},
		"not JSON":                  {refused, []byte(`<b>hi</b>`)},
		"too large":                 {refused, []byte(`{"kind":"refused","key":"` + strings.Repeat("k", MaxEventSize) + `"}`)},
	} {
		if _, err := decodeEvent("leasehold", c.subject, c.data); !errors.Is(err, ErrBadEvent) {
			t.Errorf("%s: got %v, want ErrBadEvent", name, err)
		}
	}
	// Markup is text, and valid: the page renders it as text.
	if _, err := decodeEvent("leasehold", refused, with(func(e *Event) { e.Worker = `<img src=x onerror=alert(1)>` })); err != nil {
		t.Errorf("markup in a field: %v", err)
	}
}

// A partition taken from a holder that did not release it is a take-over;
// from one that did, a hand-off; a first acquisition is neither.
func TestHistoryTellsTakeOversFromHandOffs(t *testing.T) {
	t.Parallel()
	h := newHistory()
	at := time.Now()
	ev := func(kind, worker string, p uint32, e uint64) Event {
		at = at.Add(time.Second)
		return Event{Kind: kind, Time: at, Scope: "orders", Partition: p, Worker: worker, Epoch: e}
	}
	h.add(ev(KindAcquired, "a", 0, 10))
	h.add(ev(KindAcquired, "a", 1, 11))
	h.add(ev(KindAcquired, "b", 0, 20)) // a froze: taken over
	h.add(ev(KindReleased, "a", 1, 11))
	h.add(ev(KindAcquired, "b", 1, 21)) // a drained first: handed off
	h.add(ev(KindReleased, "a", 0, 10)) // late, from the old holder: changes nothing
	h.add(ev(KindAcquired, "c", 0, 30))
	h.add(ev(KindLost, "a", 0, 10))
	// A release that arrives after its successor's acquisition, but
	// happened before it.
	at = at.Add(time.Second)
	acquired := ev(KindAcquired, "d", 2, 40)
	h.add(ev(KindAcquired, "c", 2, 31))
	h.add(acquired)
	h.add(Event{Kind: KindReleased, Time: acquired.Time.Add(-time.Millisecond), Scope: "orders", Partition: 2, Worker: "c", Epoch: 31})
	want := []Move{
		{Kind: "take-over", Partition: 0, From: "a", FromEpoch: 10, To: "b", Epoch: 20},
		{Kind: "hand-off", Partition: 1, From: "a", FromEpoch: 11, To: "b", Epoch: 21},
		{Kind: "take-over", Partition: 0, From: "b", FromEpoch: 20, To: "c", Epoch: 30},
		{Kind: "hand-off", Partition: 2, From: "c", FromEpoch: 31, To: "d", Epoch: 40},
	}
	if len(h.moves) != len(want) {
		t.Fatalf("moves %+v, want %+v", h.moves, want)
	}
	for i, m := range h.moves {
		w := want[i]
		if m.Kind != w.Kind || m.Partition != w.Partition || m.From != w.From || m.FromEpoch != w.FromEpoch || m.To != w.To || m.Epoch != w.Epoch {
			t.Errorf("move %d: %+v, want %+v", i, m, w)
		}
	}
	if len(h.losses) != 1 {
		t.Errorf("losses %+v", h.losses)
	}
	h.expire(at.Add(time.Hour))
	if len(h.moves)+len(h.losses) != 0 {
		t.Errorf("nothing expired: %d moves, %d losses", len(h.moves), len(h.losses))
	}
}

// The hooks run on the fenced path: with no events stream to publish to,
// and a queue of one, every event is dropped and counted, and Publish
// returns each time.
func TestPublisherDropsRatherThanWaits(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	p := NewPublisher(PublisherConfig{JetStream: js, Prefix: "missing", Queue: 1})
	const n = 1000
	for range n {
		p.Publish(Event{Kind: KindLost, Scope: "missing"})
	}
	p.Close()
	if got := p.Dropped(); got != n {
		t.Errorf("%d of %d events dropped, want all", got, n)
	}
}

// What a process publishes about itself always validates, whatever its
// names hold, and the page server reads it back from the stream and
// streams it as server-sent events with headers that keep the page to its
// own script.
func TestPublishedEventsReachTheEventStream(t *testing.T) {
	t.Parallel()
	js, _, ctx := withEvents(t)
	p := NewPublisher(PublisherConfig{JetStream: js, Prefix: "leasehold", Source: "sink\x00" + strings.Repeat("é", 300)})
	p.Publish(Event{Kind: KindRefused, Scope: "orders", Worker: "zombie\n", Epoch: 1, Max: 2, Outcome: "stale"})
	p.Close()
	if p.Dropped() != 0 {
		t.Fatalf("%d dropped", p.Dropped())
	}
	srv := New(Config{JetStream: js, Prefix: "leasehold", ServedBy: "test", Refresh: 50 * time.Millisecond})
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); srv.Run(rctx) }()
	defer func() { stop(); <-done }()
	mux := http.NewServeMux()
	srv.Register(mux)
	hs := httptest.NewServer(mux)
	defer hs.Close()

	req, _ := http.NewRequestWithContext(ctx, "GET", hs.URL+"/status/events", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Errorf("Content-Type %q", ct)
	}
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "script-src 'self'") || strings.Contains(csp, "unsafe-inline") {
		t.Errorf("Content-Security-Policy %q", csp)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		var st State
		if err := json.Unmarshal([]byte(line), &st); err != nil {
			t.Fatalf("a state that is not JSON: %v", err)
		}
		if len(st.Refusals) == 1 {
			r := st.Refusals[0]
			if r.Worker != "zombie" || len(r.Source) > maxText || strings.ContainsRune(r.Source, 0) || r.Epoch != 1 || r.Max != 2 {
				t.Errorf("refusal %+v", r)
			}
			return
		}
	}
	t.Fatalf("the stream ended without the refusal: %v", sc.Err())
}

// Every worker and sink serves the page; until someone opens it, it reads
// nothing: no lease bucket, no consumer on the events stream.
func TestIdlePageReadsNothing(t *testing.T) {
	t.Parallel()
	js, stream, ctx := withEvents(t)
	srv := New(Config{JetStream: js, Prefix: "leasehold", Refresh: 20 * time.Millisecond})
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); srv.Run(rctx) }()
	defer func() { stop(); <-done }()
	time.Sleep(200 * time.Millisecond) // ten refresh intervals in which nothing may happen
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	srv.mu.Lock()
	read := !srv.snapAt.IsZero()
	srv.mu.Unlock()
	if info.State.Consumers != 0 || read {
		t.Fatalf("an unwatched page read: %d consumers on the events stream, snapshot read %v", info.State.Consumers, read)
	}
	mux := http.NewServeMux()
	srv.Register(mux)
	hs := httptest.NewServer(mux)
	defer hs.Close()
	resp, err := http.Get(hs.URL + "/status.json")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	for {
		info, err := stream.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.State.Consumers == 1 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal("a viewer's request did not start the events reader")
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// A named lock passed from one coordinator to another shows as a hand-off
// of the lock's scope, and the page lists the lock with its holder.
func TestLockHandOffShows(t *testing.T) {
	t.Parallel()
	js, _, ctx := withEvents(t)
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{MarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	p := NewPublisher(PublisherConfig{JetStream: js, Prefix: "leasehold", Source: "test"})
	for _, w := range []string{"a", "b"} {
		c, err := coordinator.New(b, coordinator.Config{Worker: w, TTL: 2 * time.Second, Observer: p.LockObserver(nil),
			Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		l, err := c.Lock(ctx, "nightly-report")
		if err != nil {
			t.Fatal(err)
		}
		if w == "a" {
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		} else {
			defer l.Release(context.Background())
		}
	}
	p.Close()
	srv := New(Config{JetStream: js, Bucket: b, Prefix: "leasehold", Refresh: 50 * time.Millisecond})
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); srv.Run(rctx) }()
	defer func() { stop(); <-done }()
	srv.touch(0)
	for {
		st := srv.State()
		if len(st.Moves) == 1 && len(st.Locks) == 1 {
			m, l := st.Moves[0], st.Locks[0]
			if m.Kind != "hand-off" || m.From != "a" || m.To != "b" || m.Epoch <= m.FromEpoch || !strings.HasSuffix(m.Scope, "/nightly-report") || m.Lock != "nightly-report" {
				t.Errorf("move %+v", m)
			}
			if l.Name != "nightly-report" || l.Holder != "b" {
				t.Errorf("lock row %+v", l)
			}
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no hand-off of the lock: moves %+v, locks %+v, errors %v", st.Moves, st.Locks, st.Errors)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Actions and endpoint events are checked as every event is, and fold
// into the page's lists: each action in turn, each endpoint as its last
// event left it.
func TestActionAndEndpointEvents(t *testing.T) {
	t.Parallel()
	now := time.Now()
	action := Event{Kind: KindAction, Time: now, Source: "page-1", Actor: "ana (token)", Action: ActionReplay, Target: "shop-dlq 7", Result: "replayed as 0:12"}
	down := Event{Kind: KindEndpoint, Time: now, Source: "sink-1", Relay: "orders-api", Endpoint: "default", Origin: "http://127.0.0.1:9", Down: true, Since: now.Add(-time.Minute), Reason: "connection refused"}
	for _, e := range []Event{action, down} {
		if _, err := decodeEvent("shop", EventSubject("shop", e.Kind), encode(t, e)); err != nil {
			t.Errorf("a good %s event: %v", e.Kind, err)
		}
	}
	with := func(e Event, f func(*Event)) Event { f(&e); return e }
	for name, c := range map[string]struct {
		subject string
		e       Event
	}{
		"an action with no actor":        {EventSubject("shop", KindAction), with(action, func(e *Event) { e.Actor = "" })},
		"an action on another's subject": {EventSubject("shop", KindRefused), action},
		"an action with markup bytes":    {EventSubject("shop", KindAction), with(action, func(e *Event) { e.Result = "ok\x1b[2J" })},
		"an endpoint with no name":       {EventSubject("shop", KindEndpoint), with(down, func(e *Event) { e.Endpoint = "" })},
		"an endpoint on a lease subject": {EventSubject("shop", KindAcquired), down},
	} {
		if _, err := decodeEvent("shop", c.subject, encode(t, c.e)); !errors.Is(err, ErrBadEvent) {
			t.Errorf("%s: %v, want ErrBadEvent", name, err)
		}
	}
	h := newHistory()
	h.add(action)
	h.add(down)
	up := with(down, func(e *Event) {
		e.Down, e.Time, e.Since, e.Reason = false, now.Add(time.Second), now.Add(time.Second), ""
	})
	if d := h.destinations(); len(d) != 1 || !d[0].Down || d[0].Error != "connection refused" || !d[0].Since.Equal(down.Since) {
		t.Fatalf("down: %+v", d)
	}
	h.add(up)
	if d := h.destinations(); len(d) != 1 || d[0].Down || d[0].Error != "" {
		t.Fatalf("up again: %+v", d)
	}
	if len(h.actions) != 1 {
		t.Fatalf("actions %+v", h.actions)
	}
	h.expire(now.Add(time.Hour))
	if len(h.actions)+len(h.destinations()) != 0 {
		t.Errorf("nothing expired")
	}
}
