package streamsink_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// An effect its handler always fails is moved, after MaxDeliveries tries,
// to the dead-letter stream with its data, its leasehold and trace headers
// (and no Nats- header) and headers saying what failed where; it is
// reported DeadLettered, and the effects after it are applied. With a
// BatchHandler, the batch that holds it fails as a whole, and only that
// effect is dead-lettered.
func TestDeadLetterAfterMaxDeliveries(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	eachAndBatch(t, func(t *testing.T, batch bool, name string) {
		ctx := ctxFor(t, time.Minute)
		js := srv.JetStream(t)
		prefix := "dl" + name
		var (
			mu      sync.Mutex
			got     []string
			tries   int
			largest int
		)
		refuse := errors.New("the destination refuses this one")
		apply := func(e sink.Effect) error {
			if e.Stamp.Key == "bad" {
				tries++
				return fmt.Errorf("key %s: %w", e.Stamp.Key, refuse)
			}
			return nil
		}
		rec := &positions{}
		cfg := streamsink.Config{Prefix: prefix, Provision: true, MaxDeliveries: 3, MaxBackoff: 10 * time.Millisecond, Observer: rec, Logger: quiet()}
		if batch {
			cfg.BatchHandler = func(_ context.Context, effects []sink.Effect) error {
				mu.Lock()
				defer mu.Unlock()
				largest = max(largest, len(effects))
				for _, e := range effects {
					if err := apply(e); err != nil {
						return err
					}
				}
				for _, e := range effects {
					got = append(got, e.Stamp.Key)
				}
				return nil
			}
		} else {
			cfg.Handler = func(_ context.Context, e sink.Effect) error {
				mu.Lock()
				defer mu.Unlock()
				if err := apply(e); err != nil {
					return err
				}
				got = append(got, e.Stamp.Key)
				return nil
			}
		}
		r, err := streamsink.New(ctx, js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
		var bad, last uint64
		for _, key := range []string{"e0", "e1", "bad", "e3", "e4"} {
			h := nats.Header{}
			leasehold.Stamp{Scope: prefix, Epoch: 3, Acquisition: "a3", Key: key, Worker: "w3"}.SetHeader(h)
			h.Set("Traceparent", traceparent)
			h.Set("Leasehold-Note", "kept")
			h.Set("X-Other", "dropped")
			h.Set(jetstream.MsgIDHeader, "id-"+key)
			ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: prefix + ".out.p0", Header: h, Data: []byte("data of " + key)})
			if err != nil {
				t.Fatal(err)
			}
			if key == "bad" {
				bad = ack.Sequence
			}
			last = ack.Sequence
		}
		rr := run(t, r)
		if err := rr.WaitPosition(ctx, last); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		if want := []string{"e0", "e1", "e3", "e4"}; !slices.Equal(got, want) {
			t.Errorf("applied %v, want %v", got, want)
		}
		if batch && largest < 2 {
			t.Errorf("the batch handler was never given more than %d effects: the test did not batch", largest)
		}
		if tries < 3 {
			t.Errorf("the bad effect was tried %d times, want at least MaxDeliveries (3)", tries)
		}
		mu.Unlock()
		if d, ok := rec.at(bad); !ok || d.Outcome != sink.DeadLettered || !errors.Is(d.Err, refuse) {
			t.Errorf("decision at %d: %+v (%v), want dead_lettered with the handler's error", bad, d, ok)
		}
		if d, ok := rec.at(last); !ok || d.Outcome != sink.Accepted {
			t.Errorf("decision at %d: %+v, want accepted", last, d)
		}

		dlq, err := js.Stream(ctx, prefix+"-sink-dlq")
		if err != nil {
			t.Fatal(err)
		}
		info, err := dlq.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.State.Msgs != 1 {
			t.Fatalf("%d dead letters, want 1", info.State.Msgs)
		}
		m, err := dlq.GetMsg(ctx, info.State.FirstSeq)
		if err != nil {
			t.Fatal(err)
		}
		st, err := leasehold.StampFromHeader(m.Header)
		if err != nil || st.Key != "bad" || st.Scope != prefix {
			t.Errorf("dead letter's stamp %+v (%v), want the effect's", st, err)
		}
		if m.Subject != prefix+".sinkdlq."+prefix+"-sink" || string(m.Data) != "data of bad" {
			t.Errorf("dead letter on %s with %q", m.Subject, m.Data)
		}
		for k, want := range map[string]string{
			"Traceparent":                       traceparent,
			"Leasehold-Note":                    "kept",
			streamsink.HeaderSinkName:           "stream",
			streamsink.HeaderSinkLog:            prefix + "-effects",
			streamsink.HeaderSinkSubject:        prefix + ".out.p0",
			streamsink.HeaderSinkPosition:       strconv.FormatUint(bad, 10),
			streamsink.HeaderSinkTries:          "3",
			streamsink.HeaderSinkError + "~sub": refuse.Error(),
		} {
			k, sub := strings.CutSuffix(k, "~sub")
			if v := m.Header.Get(k); v != want && !(sub && strings.Contains(v, want)) {
				t.Errorf("dead letter header %s: %q, want %q", k, v, want)
			}
		}
		for k := range m.Header {
			if strings.HasPrefix(strings.ToLower(k), "nats-") || k == "X-Other" {
				t.Errorf("dead letter carries header %s: %v", k, m.Header[k])
			}
		}
	})
}

// A handler's error matching ErrPoison dead-letters the effect at once.
func TestDeadLetterPoisonAtOnce(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	var tries int
	rec := &positions{}
	cfg := streamsink.Config{Prefix: "poison", Provision: true, Observer: rec, Logger: quiet(),
		Handler: func(_ context.Context, e sink.Effect) error {
			tries++
			return fmt.Errorf("%w: no such table", streamsink.ErrPoison)
		}}
	rr := start(t, js, cfg)
	seq := publishStamped(t, ctx, js, "poison.out.p0", "poison", 1, "k", false)
	if err := rr.WaitPosition(ctx, seq); err != nil {
		t.Fatal(err)
	}
	if d, _ := rec.at(seq); d.Outcome != sink.DeadLettered || tries != 1 {
		t.Fatalf("decision %v after %d tries, want dead_lettered after 1", d.Outcome, tries)
	}
}

// An effect that fits in the log but not, with the sink's headers added,
// in a republish is dead-lettered at once; its dead letter, too large as
// well, is stored without the data, which the log keeps. The effects
// after it are republished.
func TestDeadLetterRepublishTooLarge(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	nc := srv.Connect(t)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	const prefix = "large"
	rec := &positions{}
	rr := start(t, js, streamsink.Config{Prefix: prefix, Provision: true, Observer: rec, Logger: quiet()})
	msg := func(key string, n int) *nats.Msg {
		m := nats.NewMsg(prefix + ".out.p0")
		leasehold.Stamp{Scope: prefix, Epoch: 1, Acquisition: "a1", Key: key, Worker: "w1"}.SetHeader(m.Header)
		m.Data = make([]byte, n)
		return m
	}
	fit := largestFit(t, nc, func(n int) *nats.Msg { return msg("big", n) })
	ack, err := js.PublishMsg(ctx, msg("big", fit))
	if err != nil {
		t.Fatal(err)
	}
	big := ack.Sequence
	if ack, err = js.PublishMsg(ctx, msg("small", 10)); err != nil {
		t.Fatal(err)
	}
	if err := rr.WaitPosition(ctx, ack.Sequence); err != nil {
		t.Fatal(err)
	}
	if d, _ := rec.at(big); d.Outcome != sink.DeadLettered || !errors.Is(d.Err, nats.ErrMaxPayload) {
		t.Fatalf("the oversized republish: %v (%v), want dead_lettered for the max payload", d.Outcome, d.Err)
	}
	if d, _ := rec.at(ack.Sequence); d.Outcome != sink.Accepted {
		t.Fatalf("the effect after it: %v, want accepted", d.Outcome)
	}
	dlq, err := js.Stream(ctx, prefix+"-sink-dlq")
	if err != nil {
		t.Fatal(err)
	}
	m, err := dlq.GetLastMsgForSubject(ctx, prefix+".sinkdlq.>")
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get(streamsink.HeaderSinkData) != "omitted" || len(m.Data) != 0 || m.Header.Get(streamsink.HeaderSinkPosition) != strconv.FormatUint(big, 10) {
		t.Fatalf("dead letter: %d bytes, headers %v", len(m.Data), m.Header)
	}
	got, err := downstream(ctx, js, prefix+"-fenced")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Stamp.Key != "small" {
		t.Fatalf("downstream holds %d effects, want only the small one", len(got))
	}
}

// A failure that is NATS's own (here a timeout, as a handler writing to a
// restarting server sees) blames no effect: it is retried past
// MaxDeliveries and applied once NATS answers.
func TestDeadLetterNotForNATSFailures(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	var calls [][]string // the keys of each call's effects
	rec := &positions{}
	cfg := streamsink.Config{Prefix: "away", Provision: true, MaxDeliveries: 2, MaxBackoff: 10 * time.Millisecond, Observer: rec, Logger: quiet(),
		BatchHandler: func(_ context.Context, effects []sink.Effect) error {
			var keys []string
			for _, e := range effects {
				keys = append(keys, e.Stamp.Key)
			}
			if calls = append(calls, keys); len(calls) <= 5 {
				return fmt.Errorf("write %d effects: %w", len(effects), nats.ErrTimeout)
			}
			return nil
		}}
	r, err := streamsink.New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	publishStamped(t, ctx, js, "away.out.p0", "away", 1, "k0", false)
	seq := publishStamped(t, ctx, js, "away.out.p0", "away", 1, "k1", false)
	rr := run(t, r)
	if err := rr.WaitPosition(ctx, seq); err != nil {
		t.Fatal(err)
	}
	for _, at := range []uint64{seq - 1, seq} {
		if d, _ := rec.at(at); d.Outcome != sink.Accepted {
			t.Fatalf("decision at %d: %v (%v), want accepted", at, d.Outcome, d.Err)
		}
	}
	// The two effects may come in one batch or two, as the first fetch
	// finds them. A failed call is tried again with the same effects,
	// never split to find one to dead-letter, and each effect is written
	// once it succeeds.
	if len(calls) < 6 {
		t.Fatalf("batch handler calls %v: want 5 failures and what follows", calls)
	}
	for i := 1; i <= 5; i++ {
		if !slices.Equal(calls[i], calls[i-1]) {
			t.Fatalf("batch handler calls %v: call %d after a NATS failure holds other effects than the one before; want the batch tried again whole", calls, i+1)
		}
	}
	var written []string
	for _, keys := range calls[5:] {
		written = append(written, keys...)
	}
	if !slices.Equal(written, []string{"k0", "k1"}) {
		t.Fatalf("batch handler calls %v: written after the failures %v, want k0 and k1 once each", calls, written)
	}
}

// largestFit returns the largest n for which the server takes msg(n),
// found by bisection with publishes nothing stores (the client refuses an
// oversized one before sending it). One by one, the 500 publishes of a
// megabyte took 13s under the race detector, and a minute on a busy
// machine.
func largestFit(t *testing.T, nc *nats.Conn, msg func(n int) *nats.Msg) int {
	t.Helper()
	fits := func(n int) bool {
		m := msg(n)
		m.Subject = "nowhere"
		err := nc.PublishMsg(m)
		if err != nil && !errors.Is(err, nats.ErrMaxPayload) {
			t.Fatal(err)
		}
		return err == nil
	}
	lo, hi := int(nc.MaxPayload())-512, int(nc.MaxPayload()) // lo fits, hi does not
	if !fits(lo) || fits(hi) {
		t.Fatalf("a message of %d bytes should fit and one of %d not", lo, hi)
	}
	for hi-lo > 1 {
		if mid := (lo + hi) / 2; fits(mid) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}
