package streamsink_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// Packed effects against the runner's bounds on what it holds
// (Config.MaxHeldEffects, MaxHeldBytes): a pack is one log message but
// counts as the effects it holds.

// A pack of six effects of one attempt, its final, under a bound of four
// held effects, or of their data: the runner stops at the bound in the
// pack and says so in Ready (ErrGroupLimit), applies none
// of the job (never a part of it), and, restarted with the bound raised,
// applies it whole, once, in one call. Closed.
func TestAttackPackPastHeldBound(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	for _, bound := range []string{"effects", "bytes"} {
		t.Run(bound, func(t *testing.T) {
			js := srv.JetStream(t)
			pl := newPackLog(t, js, "pklim"+bound, leasehold.StampCompact)
			cfg := pl.cfg
			if bound == "effects" {
				cfg.MaxHeldEffects = 4
			} else {
				// Each effect takes about 200 bytes: its data, "<key>/a1", and its
				// headers (stamp, mark, X-Effect, X-Tag).
				cfg.MaxHeldBytes = 600
			}
			r := start(t, js, cfg)
			keys := keysOf(pl, 3, 6)
			seq := pl.pack(keys, "a1", leasehold.JobMark{Job: 3, Attempt: 1, Effects: 6})
			// Ready fails too before Run has begun: the wait is for the bound.
			err := awaitReady(t, ctxFor(t, time.Minute), r.Runner, "the held bound", func(err error) bool { return errors.Is(err, streamsink.ErrGroupLimit) })
			if !strings.Contains(err.Error(), "log position "+strconv.FormatUint(seq, 10)) {
				t.Fatalf("Ready: %v; want ErrGroupLimit at log position %d", err, seq)
			}
			pl.want(map[string][]string{})
			if err := r.stop(); err != nil && !errors.Is(err, streamsink.ErrGroupLimit) {
				t.Fatal(err)
			}
			again := start(t, js, pl.cfg)
			pl.wait(again, seq)
			want := map[string][]string{}
			for _, k := range keys {
				want[k] = []string{"a1"}
			}
			pl.want(want)
			if calls := pl.callsOf(); len(calls) != 1 || !slices.Equal(calls[0], keys) {
				t.Fatalf("handler calls %v, want one holding %v", calls, keys)
			}
		})
	}
}

// An effect can carry its weight in headers rather than data: here four
// packs of jobs that never complete, each with one effect of about 50 KB
// of headers (480 pairs, within what an effect's own headers may take)
// and no data, under Config.MaxHeldBytes of 64 KiB. The runner must stop at the bound and say so in Ready, as it does
// for data. (It counted only data: it held them all, about 200 KB of
// header text and many times that in header maps, and went on with
// nothing to show it was past its bound. A single effect can carry such
// headers too; a pack carries more per message, and reading one
// allocates about 38 times its size in leasehold.Unpack, where decoding a
// message's headers allocates about 17.)
func TestAttackPackHeadersPastHeldBytes(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pkhdr", leasehold.StampCompact)
	cfg := pl.cfg
	cfg.MaxHeldBytes = 64 << 10
	r := start(t, js, cfg)
	big := map[string][]string{}
	value := strings.Repeat("v", 96)
	for i := range 480 {
		big["X-H"+strconv.Itoa(i)] = []string{value}
	}
	for job := uint64(1); job <= 4; job++ {
		keys := keysOf(pl, job, 2)
		body := leasehold.AppendPacked(nil, leasehold.PackedEffect{Key: keys[0], Header: big})
		body = leasehold.AppendPacked(body, leasehold.PackedEffect{Key: keys[1]})
		h := stampedHeader(pl, keys[1], leasehold.JobMark{Job: job, Attempt: 1})
		leasehold.SetPackHeader(h, 2)
		pl.publish(h, body)
	}
	after := pl.one("standalone", "a1", leasehold.JobMark{})
	decided := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { decided <- r.WaitPosition(ctx, after) }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := ctxFor(t, time.Minute)
	for {
		select {
		case err := <-decided:
			if err == nil {
				t.Fatalf("the runner holds four effects of about 50 KB of headers each past MaxHeldBytes %d and went on to log position %d; Ready says %v", cfg.MaxHeldBytes, after, r.Ready(ctx))
			}
			t.Fatal(err)
		case <-tick.C:
			if err := r.Ready(ctx); errors.Is(err, streamsink.ErrGroupLimit) {
				return
			}
		case <-deadline.Done():
			t.Fatal("the runner neither stopped at its bound nor decided the log")
		}
	}
}

// stampedHeader is the headers of a message of pl's log stamped with key
// under epoch 1 and marked with mark, in pl's form.
func stampedHeader(pl *packLog, key string, mark leasehold.JobMark) nats.Header {
	h := nats.Header{}
	pl.stamp(1, key).SetHeaderAs(h, pl.form)
	mark.SetHeaderAs(h, pl.form)
	return h
}
