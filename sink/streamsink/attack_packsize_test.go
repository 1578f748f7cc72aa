package streamsink_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A stream takes at most 64 KiB of headers in a message (JetStream API
// error 10097), whatever its max payload. A packed message carries its
// effects' headers in its body, where the server does not look: one entry
// here carries a baggage header (trace context, which the runner keeps on
// what it republishes and dead-letters) of nearly a megabyte. Expanded and
// republished, the effect was refused by the downstream stream, then by
// the dead-letter stream, which the runner retried for ever: the job's
// other effect and everything after it in the log waited behind it, and
// Ready said nothing until StallAfter. The effect now goes to the
// dead-letter stream at once, without its own headers, as an effect too
// large to republish does; the job's other effect is republished, and the
// runner goes on. (A Handler or BatchHandler takes such an effect as it
// is: only what is stored in a stream meets the wall.)
func TestAttackPackEntryHeaderPastWhatAStreamTakes(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pksize", leasehold.StampCompact)
	pl.cfg.BatchHandler = nil // republish
	r := start(t, js, pl.cfg)
	keys := keysOf(pl, 4, 2)
	big := strings.Repeat("b", int(js.Conn().MaxPayload())-4096)
	body := leasehold.AppendPacked(nil, leasehold.PackedEffect{Key: keys[0], Header: map[string][]string{"Baggage": {big}}, Data: []byte("x")})
	body = leasehold.AppendPacked(body, leasehold.PackedEffect{Key: keys[1], Data: []byte("y")})
	h := stampedHeader(pl, keys[1], leasehold.JobMark{Job: 4, Attempt: 1, Effects: 2})
	leasehold.SetPackHeader(h, 2)
	seq := pl.publish(h, body)
	after := pl.one("standalone", "a1", leasehold.JobMark{})
	ctx := ctxFor(t, time.Minute)
	if err := r.WaitPosition(ctx, after); err != nil {
		t.Fatalf("the runner is held at the pack at %d: %v; Ready says %v", seq, err, r.Ready(ctx))
	}
	if got := pl.outcomes(seq); got[keys[0]] != sink.DeadLettered || got[keys[1]] != sink.Accepted {
		t.Fatalf("decisions at %d: %v; want %s dead-lettered and %s accepted", seq, got, keys[0], keys[1])
	}
	out, err := downstream(ctx, js, "pksize-fenced")
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != 2 || out[0].Stamp.Key != keys[1] || out[1].Stamp.Key != "standalone" {
		t.Fatalf("downstream holds %d effects, want %s and the standalone one", len(out), keys[1])
	}
	wantTrimmedDeadLetter(t, js, "pksize", keys[0])
}

// wantTrimmedDeadLetter fails unless the last dead letter of the runner
// under prefix is the effect of key, stored without its own headers.
func wantTrimmedDeadLetter(t *testing.T, js jetstream.JetStream, prefix, key string) {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	s, err := js.Stream(ctx, prefix+"-sink-dlq")
	if err != nil {
		t.Fatal(err)
	}
	dl, err := s.GetLastMsgForSubject(ctx, prefix+".sinkdlq."+prefix+"-sink")
	if err != nil {
		t.Fatal(err)
	}
	if st, err := leasehold.StampFromHeader(dl.Header); err != nil || st.Key != key || dl.Header.Get(streamsink.HeaderSinkData) == "" || dl.Header.Get("Baggage") != "" {
		t.Fatalf("dead letter: stamp %+v (%v), %s %q, baggage of %d bytes", st, err, streamsink.HeaderSinkData, dl.Header.Get(streamsink.HeaderSinkData), len(dl.Header.Get("Baggage")))
	}
}

// The same wall for an effect alone: its headers, with its stamp, nearly
// fill the 64 KiB a stream takes, so it is stored in the log, but not
// republished (the runner adds a message ID and trace context), and its
// dead letter, with the sink's headers besides, would not be stored
// either. It is dead-lettered without its own headers (the stamp, the job
// mark and the sink's headers say what it was, and where the log keeps it
// whole), and the runner goes on. It was retried for ever.
func TestAttackEffectHeadersAtWhatAStreamTakes(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pkwall", leasehold.StampCompact)
	pl.cfg.BatchHandler = nil // republish
	r := start(t, js, pl.cfg)
	ctx := ctxFor(t, time.Minute)
	// The largest baggage the log takes, to 16 bytes.
	var seq uint64
	for size := 1 << 16; seq == 0; size -= 16 {
		if size < 60000 {
			t.Fatal("the log refuses every baggage header tried")
		}
		h := stampedHeader(pl, "wall", leasehold.JobMark{})
		h.Set("Baggage", strings.Repeat("b", size))
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: "pkwall.out.0", Header: h, Data: []byte("x")})
		var apiErr *jetstream.APIError
		switch {
		case err == nil:
			seq = ack.Sequence
		case errors.As(err, &apiErr) && apiErr.ErrorCode == 10097, errors.Is(err, nats.ErrMaxPayload):
		default:
			t.Fatal(err)
		}
	}
	after := pl.one("standalone", "a1", leasehold.JobMark{})
	if err := r.WaitPosition(ctx, after); err != nil {
		t.Fatalf("the runner is held at the effect at %d: %v; Ready says %v", seq, err, r.Ready(ctx))
	}
	if got := pl.outcomes(seq); got["wall"] != sink.DeadLettered {
		t.Fatalf("decisions at %d: %v; want it dead-lettered", seq, got)
	}
	wantTrimmedDeadLetter(t, js, "pkwall", "wall")
}
