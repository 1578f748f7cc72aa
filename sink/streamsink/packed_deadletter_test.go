package streamsink_test

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/statuspage/deadletter"
	"github.com/leasehold/leasehold/testing/natstest"
)

// An effect of a packed message whose delivery keeps failing goes to the
// dead-letter stream as the effect alone: its own stamp and mark, its data,
// no Leasehold-Pack, the message's position; the others of the message
// apply. Replayed (`leasehold dlq replay --sink`), it applies.
func TestPackedEffectDeadLetteredAndReplayed(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pkdl", leasehold.StampCompact)
	pl.cfg.MaxDeliveries = 2
	keys := keysOf(pl, 9, 3)
	refusing := true
	pl.refuse = func(e sink.Effect) error {
		if refusing && e.Stamp.Key == keys[1] {
			return errors.New("the destination refuses this one")
		}
		return nil
	}
	r := start(t, js, pl.cfg)
	seq := pl.pack(keys, "a1", leasehold.JobMark{Job: 9, Attempt: 1, Effects: 3})
	pl.wait(r, seq)
	pl.want(map[string][]string{keys[0]: {"a1"}, keys[2]: {"a1"}})
	if got := pl.outcomes(seq); got[keys[0]] != sink.Accepted || got[keys[1]] != sink.DeadLettered || got[keys[2]] != sink.Accepted {
		t.Fatalf("decisions at %d: %v", seq, got)
	}

	ctx := ctxFor(t, time.Minute)
	s, err := js.Stream(ctx, "pkdl-sink-dlq")
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.Msgs != 1 {
		t.Fatalf("dead-letter stream: %+v, %v; want one dead letter", info, err)
	}
	dl, err := s.GetMsg(ctx, info.State.LastSeq)
	if err != nil {
		t.Fatal(err)
	}
	st, err := leasehold.StampFromHeader(dl.Header)
	if err != nil || st.Key != keys[1] || st.Epoch != 1 || st.Scope != "pkdl" {
		t.Fatalf("dead letter stamp %+v, %v; want key %s", st, err, keys[1])
	}
	if mark, err := leasehold.JobMarkFromHeader(dl.Header); err != nil || mark != (leasehold.JobMark{Job: 9, Attempt: 1}) {
		t.Fatalf("dead letter mark %+v, %v", mark, err)
	}
	if string(dl.Data) != keys[1]+"/a1" || dl.Header.Get(streamsink.HeaderSinkPosition) != strconv.FormatUint(seq, 10) {
		t.Fatalf("dead letter data %q at position %s; want %q at %d", dl.Data, dl.Header.Get(streamsink.HeaderSinkPosition), keys[1]+"/a1", seq)
	}
	for k := range dl.Header {
		if strings.EqualFold(k, leasehold.HeaderPack) {
			t.Fatalf("dead letter carries %s: %v", k, dl.Header)
		}
	}

	pl.mu.Lock()
	refusing = false
	pl.mu.Unlock()
	d := deadletter.New(js, s, "pkdl", true, "")
	m, err := d.Get(ctx, dl.Sequence)
	if err != nil {
		t.Fatal(err)
	}
	res, err := d.Replay(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	pl.wait(r, res.Seq)
	pl.want(map[string][]string{keys[0]: {"a1"}, keys[1]: {"a1"}, keys[2]: {"a1"}})
	if got := pl.outcomes(res.Seq); got[keys[1]] != sink.Accepted {
		t.Fatalf("the replay at %d: %v", res.Seq, got)
	}
}

// Republished into the downstream stream, each effect of a packed message
// is a message of its own: its stamp, its mark, a message ID of its key,
// and no Leasehold-Pack.
func TestPackedRepublished(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	for _, form := range []leasehold.StampFormat{leasehold.StampCompact, leasehold.StampLegacy} {
		t.Run(form.String(), func(t *testing.T) {
			js := srv.JetStream(t)
			prefix := "pkrep" + form.String()
			pl := newPackLog(t, js, prefix, form)
			pl.cfg.BatchHandler = nil
			r := start(t, js, pl.cfg)
			keys := keysOf(pl, 4, 3)
			final := leasehold.JobMark{Job: 4, Attempt: 2, Effects: 3}
			pl.wait(r, pl.pack(keys, "a2", final))
			ctx := ctxFor(t, time.Minute)
			out, err := downstream(ctx, js, prefix+"-fenced")
			if err != nil {
				t.Fatal(err)
			}
			if len(out) != 3 {
				t.Fatalf("%d effects downstream, want 3", len(out))
			}
			for i, e := range out {
				mark, err := leasehold.JobMarkFromHeader(e.Header)
				want := leasehold.JobMark{Job: 4, Attempt: 2}
				if i == 2 {
					want = final
				}
				if e.Stamp.Key != keys[i] || string(e.Data) != keys[i]+"/a2" || err != nil || mark != want ||
					nats.Header(e.Header).Get(nats.MsgIdHdr) != streamsink.MessageID(e.Stamp) {
					t.Errorf("downstream %d: %+v, mark %+v (%v)", i, e, mark, err)
				}
				for k := range e.Header {
					if strings.EqualFold(k, leasehold.HeaderPack) {
						t.Errorf("downstream %d carries %s", i, k)
					}
				}
			}
		})
	}
}
