package streamsink_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold/sink/streamsink"
)

// Statuses come without a reply subject and cannot be told from the
// server's by their content. Forged ones must not stall the runner: each
// fake end of a pull leaves the real pull open on the server, and each
// fake error costs a backoff; the runner must still handle every message
// of its log, long before the ack wait (ten minutes here), or say that it
// cannot (Ready).
//
// The forger ends each pull the runner sends, one at a time, for a while
// (64 pulls), and stops; once the pulls it ended have expired, the log
// gets 100 effects.
func TestForgedStatusesDoNotStall(t *testing.T) {
	t.Parallel()
	for _, status := range []string{"408", "404", "409", "100"} {
		t.Run(status, func(t *testing.T) {
			ctx := ctxFor(t, time.Minute)
			prefix := "atkpullstatus" + status
			pw := newPullWorld(t, prefix, streamsink.Config{Batch: 4, FetchWait: 2 * time.Second, MaxBackoff: 50 * time.Millisecond})
			first := pw.publish(t, ctx, "before")
			if err := pw.r.WaitPosition(ctx, first); err != nil {
				t.Fatal(err)
			}
			h := nats.Header{}
			h.Set("Status", status)
			h.Set("Description", "Request Timeout")
			in := ""
			for range 64 {
				// The next pull request the runner sends (the first is
				// open since the runner started). A heartbeat ends
				// nothing: there is no new pull to wait for.
				if in == "" || status != "100" {
					in = pw.pullInbox(t, ctx)
				}
				if err := pw.forger.PublishMsg(&nats.Msg{Subject: in, Header: h}); err != nil {
					t.Fatal(err)
				}
				if err := pw.forger.Flush(); err != nil {
					t.Fatal(err)
				}
			}
			// The pulls the forgery ended early are still open on the
			// server: their deliveries come on the runner's subscription
			// all the same, and their ends, each on its own pull's
			// subject, end nothing the runner waits on now.
			var last uint64
			for i := range 100 {
				last = pw.publish(t, ctx, fmt.Sprintf("real%d", i))
			}
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			if err := pw.r.WaitPosition(wctx, last); err != nil {
				t.Fatalf("after 64 pulls ended by forged %s statuses the runner stalled at %d of %d: Ready = %v", status, pw.r.Position(), last, pw.r.Ready(ctx))
			}
			if got := len(pw.keys()); got != 101 {
				t.Fatalf("applied %d effects, want 101", got)
			}
		})
	}
}

// The forger sends the inbox bursts of fake pull ends (a 408 or a 404,
// no reply subject) while the log is written, more at once than the
// runner's subscription holds. The ends name an old pull, and end nothing;
// but a full subscription drops what comes, deliveries among them, and
// the server redelivers those only after AckWait. Nothing may be lost,
// and while deliveries are out Ready must say why the runner is behind.
func TestForgedBurstOnTheInboxDoesNotStall(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"408", "404"} {
		t.Run(kind, func(t *testing.T) {
			ctx := ctxFor(t, 2*time.Minute)
			prefix := "atkpullburst" + kind
			pw := newPullWorld(t, prefix, streamsink.Config{Batch: 4, FetchWait: 2 * time.Second, AckWait: 5 * time.Second, MaxBackoff: 50 * time.Millisecond})
			inbox := pw.pullInbox(t, ctx)
			first := pw.publish(t, ctx, "before")
			if err := pw.r.WaitPosition(ctx, first); err != nil {
				t.Fatal(err)
			}
			h := nats.Header{}
			h.Set("Status", kind)
			burst := func(n int) {
				for range n {
					if err := pw.forger.PublishMsg(&nats.Msg{Subject: inbox, Header: h}); err != nil {
						t.Fatal(err)
					}
				}
				if err := pw.forger.Flush(); err != nil {
					t.Fatal(err)
				}
			}
			var last uint64
			for i := range 100 {
				if i%5 == 0 {
					burst(300)
				}
				last = pw.publish(t, ctx, fmt.Sprintf("real%d", i))
			}
			burst(200)
			// Until every effect is applied: behind, the runner is so
			// for a reason Ready gives (deliveries dropped), or it has
			// simply not got there yet.
			sawDrop := false
			for pw.r.Position() < last {
				if err := pw.r.Ready(ctx); err != nil && strings.Contains(err.Error(), "dropped") {
					sawDrop = true
				}
				wctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
				err := pw.r.WaitPosition(wctx, last)
				cancel()
				if err == nil {
					break
				}
				if ctx.Err() != nil {
					cons, _ := pw.js.Consumer(ctx, prefix+"-effects", prefix+"-sink")
					info, _ := cons.Info(context.Background())
					t.Fatalf("after bursts of forged messages (%s) on its inbox, the runner stands at log position %d of %d, and Ready = %v; consumer: %+v",
						kind, pw.r.Position(), last, pw.r.Ready(context.Background()), info)
				}
			}
			t.Logf("drops shown by Ready: %v", sawDrop)
			if got := len(pw.keys()); got != 101 {
				t.Fatalf("applied %d effects, want 101", got)
			}
		})
	}
}
