package streamsink_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
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

// packLog publishes effects into the log of a runner by hand, alone or
// packed (leasehold.HeaderPack) as a worker that packs writes them, and
// records what the runner's BatchHandler is handed, call by call, and
// every decision it reports.
type packLog struct {
	t     *testing.T
	js    jetstream.JetStream
	scope string
	form  leasehold.StampFormat
	cfg   streamsink.Config
	ids   int

	mu        sync.Mutex
	calls     [][]sink.Effect
	decisions []sink.Decision
	refuse    func(sink.Effect) error
}

func newPackLog(t *testing.T, js jetstream.JetStream, scope string, form leasehold.StampFormat) *packLog {
	pl := &packLog{t: t, js: js, scope: scope, form: form}
	pl.cfg = streamsink.Config{Prefix: scope, Provision: true, BatchHandler: pl.handle, Observer: pl, MaxBackoff: 10 * time.Millisecond, Logger: quiet()}
	return pl
}

func (pl *packLog) handle(_ context.Context, effects []sink.Effect) error {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	if pl.refuse != nil {
		for _, e := range effects {
			if err := pl.refuse(e); err != nil {
				return err
			}
		}
	}
	pl.calls = append(pl.calls, slices.Clone(effects))
	return nil
}

func (pl *packLog) Decided(_ context.Context, d sink.Decision) {
	pl.mu.Lock()
	pl.decisions = append(pl.decisions, d)
	pl.mu.Unlock()
}

// stamp is the stamp of an effect of partition 0 under epoch e.
func (pl *packLog) stamp(e leasehold.Epoch, key string) leasehold.Stamp {
	return leasehold.Stamp{Scope: pl.scope, Epoch: e, Acquisition: fmt.Sprintf("a%d", e), Key: key, Worker: fmt.Sprintf("w%d", e)}
}

func (pl *packLog) key(job uint64, i int) string { return leasehold.EffectKey(pl.scope, 0, job, i) }

// publish stores a message on the partition's output subject, under a
// message ID of its own, and returns its log position.
func (pl *packLog) publish(h nats.Header, data []byte) uint64 {
	pl.t.Helper()
	pl.ids++
	h.Set(jetstream.MsgIDHeader, fmt.Sprintf("%s-%d", pl.scope, pl.ids))
	ack, err := pl.js.PublishMsg(ctxFor(pl.t, 30*time.Second), &nats.Msg{Subject: pl.scope + ".out.0", Header: h, Data: data})
	if err != nil {
		pl.t.Fatal(err)
	}
	return ack.Sequence
}

// one publishes one effect alone, as a worker sends it: its data is
// "<key>/<tag>".
func (pl *packLog) one(key, tag string, mark leasehold.JobMark) uint64 {
	h := nats.Header{}
	pl.stamp(1, key).SetHeaderAs(h, pl.form)
	mark.SetHeaderAs(h, pl.form)
	return pl.publish(h, []byte(key+"/"+tag))
}

// abort publishes the abort marker of an attempt.
func (pl *packLog) abort(job, attempt uint64) uint64 {
	h := nats.Header{}
	pl.stamp(1, fmt.Sprintf("%s.0.%d.abort.%d", pl.scope, job, attempt)).SetHeaderAs(h, pl.form)
	leasehold.JobMark{Job: job, Attempt: attempt, Abort: true}.SetHeaderAs(h, pl.form)
	return pl.publish(h, nil)
}

// packed is a packed message's headers and body: its effects' keys, each
// with data "<key>/<tag>" and a header X-Effect naming it, stamped with
// the last key and marked with mark.
func (pl *packLog) packed(keys []string, tag string, mark leasehold.JobMark) (nats.Header, []byte) {
	var body []byte
	for _, k := range keys {
		body = leasehold.AppendPacked(body, leasehold.PackedEffect{Key: k, Header: map[string][]string{"X-Effect": {k}, "X-Tag": {tag, "second"}}, Data: []byte(k + "/" + tag)})
	}
	h := nats.Header{}
	pl.stamp(1, keys[len(keys)-1]).SetHeaderAs(h, pl.form)
	mark.SetHeaderAs(h, pl.form)
	leasehold.SetPackHeader(h, len(keys))
	return h, body
}

// pack publishes a packed message of the effects of keys.
func (pl *packLog) pack(keys []string, tag string, mark leasehold.JobMark) uint64 {
	h, body := pl.packed(keys, tag, mark)
	return pl.publish(h, body)
}

func (pl *packLog) wait(r *running, seq uint64) {
	pl.t.Helper()
	if err := r.WaitPosition(ctxFor(pl.t, time.Minute), seq); err != nil {
		pl.t.Fatal(err)
	}
}

// applied is what the handler was handed, key by key: the data of each
// delivery.
func (pl *packLog) applied() map[string][]string {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	out := map[string][]string{}
	for _, c := range pl.calls {
		for _, e := range c {
			out[e.Stamp.Key] = append(out[e.Stamp.Key], string(e.Data))
		}
	}
	return out
}

// want checks what was applied: each key's deliveries, by tag.
func (pl *packLog) want(want map[string][]string) {
	pl.t.Helper()
	got := pl.applied()
	for k, tags := range want {
		var datas []string
		for _, tag := range tags {
			datas = append(datas, k+"/"+tag)
		}
		if !slices.Equal(got[k], datas) {
			pl.t.Errorf("effect %s applied as %q, want %q", k, got[k], datas)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			pl.t.Errorf("effect %s applied as %q, want never", k, got[k])
		}
	}
}

// at returns the decisions reported for log position seq.
func (pl *packLog) at(seq uint64) []sink.Decision {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	var out []sink.Decision
	for _, d := range pl.decisions {
		if d.Position == seq {
			out = append(out, d)
		}
	}
	return out
}

// outcomes returns the outcome reported for each key at log position seq.
func (pl *packLog) outcomes(seq uint64) map[string]sink.Outcome {
	out := map[string]sink.Outcome{}
	for _, d := range pl.at(seq) {
		out[d.Stamp.Key] = d.Outcome
	}
	return out
}

func (pl *packLog) callsOf() [][]string {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	var out [][]string
	for _, c := range pl.calls {
		var keys []string
		for _, e := range c {
			keys = append(keys, e.Stamp.Key)
		}
		out = append(out, keys)
	}
	return out
}

func keysOf(pl *packLog, job uint64, n int) []string {
	var keys []string
	for i := range n {
		keys = append(keys, pl.key(job, i))
	}
	return keys
}

// A three-effect attempt packed in one message is applied all together,
// once, in one handler call, each effect with its own key, data and
// headers, stamped and marked as it would have been alone, and reported
// Accepted at the message's position. A runner that starts again from the
// saved position applies none of it again. In both stamp forms.
func TestPackedAttemptAppliesWhole(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	for _, form := range []leasehold.StampFormat{leasehold.StampCompact, leasehold.StampLegacy} {
		t.Run(form.String(), func(t *testing.T) {
			js := srv.JetStream(t)
			pl := newPackLog(t, js, "pk"+form.String(), form)
			r := start(t, js, pl.cfg)
			keys := keysOf(pl, 5, 3)
			final := leasehold.JobMark{Job: 5, Attempt: 1, Effects: 3, After: 0}
			seq := pl.pack(keys, "a1", final)
			pl.wait(r, seq)
			pl.want(map[string][]string{keys[0]: {"a1"}, keys[1]: {"a1"}, keys[2]: {"a1"}})
			if calls := pl.callsOf(); len(calls) != 1 || !slices.Equal(calls[0], keys) {
				t.Fatalf("handler calls %v, want one holding %v", calls, keys)
			}
			pl.mu.Lock()
			call := pl.calls[0]
			pl.mu.Unlock()
			for i, e := range call {
				st, err := leasehold.StampFromHeader(e.Header)
				if err != nil || st != e.Stamp || st.Key != keys[i] || st.Epoch != 1 || e.Subject != pl.scope+".out.0" {
					t.Errorf("effect %d: stamp %+v (%v) in its headers, %+v handed over, subject %s", i, st, err, e.Stamp, e.Subject)
				}
				mark, err := leasehold.JobMarkFromHeader(e.Header)
				want := leasehold.JobMark{Job: 5, Attempt: 1}
				if i == 2 {
					want = final
				}
				if err != nil || mark != want {
					t.Errorf("effect %d: mark %+v (%v), want %+v", i, mark, err, want)
				}
				if got := nats.Header(e.Header).Get("X-Effect"); got != keys[i] || !slices.Equal(e.Header["X-Tag"], []string{"a1", "second"}) {
					t.Errorf("effect %d: its own headers are X-Effect %q, X-Tag %q", i, got, e.Header["X-Tag"])
				}
				for k := range e.Header {
					if strings.EqualFold(k, leasehold.HeaderPack) {
						t.Errorf("effect %d carries %s", i, k)
					}
				}
				_, compact := e.Header[leasehold.HeaderStamp]
				_, compactMark := e.Header[leasehold.HeaderMark]
				if compact != (form == leasehold.StampCompact) || compactMark != compact {
					t.Errorf("effect %d: headers %v are not in the %s form", i, e.Header, form)
				}
			}
			if got := pl.outcomes(seq); len(got) != 3 || got[keys[0]] != sink.Accepted || got[keys[1]] != sink.Accepted || got[keys[2]] != sink.Accepted {
				t.Fatalf("decisions at %d: %v, want each key Accepted", seq, got)
			}

			if err := r.stop(); err != nil {
				t.Fatal(err)
			}
			again, err := streamsink.New(ctxFor(t, time.Minute), js, pl.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if p := again.Position(); p < seq {
				t.Fatalf("saved position %d, below the applied pack at %d", p, seq)
			}
			r2 := run(t, again)
			next := pl.one(pl.key(6, 0), "a1", leasehold.JobMark{Job: 6, Attempt: 1, Effects: 1, After: 5})
			pl.wait(r2, next)
			pl.want(map[string][]string{keys[0]: {"a1"}, keys[1]: {"a1"}, keys[2]: {"a1"}, pl.key(6, 0): {"a1"}})
		})
	}
}

// A runner that dies after delivering a pack and before saving applies it
// again, whole, from the log; a pack stored again under another message
// ID is a duplicate of the job it carries, each of its effects reported
// Duplicate.
func TestPackedAgainAndDuplicates(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pkdup", leasehold.StampCompact)
	keys := keysOf(pl, 9, 3)
	h, body := pl.packed(keys, "a1", leasehold.JobMark{Job: 9, Attempt: 1, Effects: 3})
	r, err := streamsink.New(ctxFor(t, time.Minute), js, pl.cfg)
	if err != nil {
		t.Fatal(err)
	}
	crashed := make(chan struct{})
	var once sync.Once
	r.SetHook(func(point string) error {
		if point == "delivered" {
			once.Do(func() { close(crashed) })
			return errors.New("crash after delivering")
		}
		return nil
	})
	first := pl.publish(cloneHeader(h), body)
	rr := run(t, r)
	select {
	case <-crashed:
	case <-ctxFor(t, time.Minute).Done():
		t.Fatal("the runner never delivered the pack")
	}
	if err := rr.stop(); err == nil {
		t.Fatal("the crashed runner's Run returned nil")
	}
	pl.want(map[string][]string{keys[0]: {"a1"}, keys[1]: {"a1"}, keys[2]: {"a1"}})
	r2 := start(t, js, pl.cfg)
	// The crashed runner's deliveries wait for AckWait; the next message
	// has the runner read them from the log.
	again := pl.publish(cloneHeader(h), body)
	pl.wait(r2, again)
	// Whole again, in one call: never a part of it.
	if calls := pl.callsOf(); len(calls) != 2 || !slices.Equal(calls[1], keys) {
		t.Fatalf("handler calls %v", calls)
	}
	if got := pl.outcomes(first); len(got) != 3 || got[keys[0]] != sink.Accepted || got[keys[1]] != sink.Accepted || got[keys[2]] != sink.Accepted {
		t.Fatalf("decisions at %d: %v, want each key Accepted", first, got)
	}
	pl.want(map[string][]string{keys[0]: {"a1", "a1"}, keys[1]: {"a1", "a1"}, keys[2]: {"a1", "a1"}})
	if got := pl.outcomes(again); len(got) != 3 || got[keys[0]] != sink.Duplicate || got[keys[1]] != sink.Duplicate || got[keys[2]] != sink.Duplicate {
		t.Fatalf("decisions at %d: %v, want each key Duplicate", again, got)
	}
}

// An attempt split over an effect alone, a pack of two and a final pack
// applies once the final pack is in, all its five effects in one call. An
// attempt whose packed effects an abort marker closes never applies; the
// job's next attempt, packed, does.
func TestPackedAttemptSplitAndAborted(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pksplit", leasehold.StampCompact)
	r := start(t, js, pl.cfg)
	keys := keysOf(pl, 7, 5)
	pl.one(keys[0], "a1", leasehold.JobMark{Job: 7, Attempt: 1})
	mid := pl.pack(keys[1:3], "a1", leasehold.JobMark{Job: 7, Attempt: 1})
	pl.wait(r, mid)
	pl.want(map[string][]string{})
	last := pl.pack(keys[3:], "a1", leasehold.JobMark{Job: 7, Attempt: 1, Effects: 5})
	pl.wait(r, last)
	pl.want(map[string][]string{keys[0]: {"a1"}, keys[1]: {"a1"}, keys[2]: {"a1"}, keys[3]: {"a1"}, keys[4]: {"a1"}})
	if calls := pl.callsOf(); len(calls) != 1 || !slices.Equal(calls[0], keys) {
		t.Fatalf("handler calls %v, want one holding %v", calls, keys)
	}

	k8 := keysOf(pl, 8, 3)
	aborted := pl.pack(k8[:2], "a1", leasehold.JobMark{Job: 8, Attempt: 1})
	pl.abort(8, 1)
	pl.one(k8[0], "a2", leasehold.JobMark{Job: 8, Attempt: 2})
	rerun := pl.pack(k8[1:], "a2", leasehold.JobMark{Job: 8, Attempt: 2, Effects: 3, After: 7})
	pl.wait(r, rerun)
	pl.want(map[string][]string{keys[0]: {"a1"}, keys[1]: {"a1"}, keys[2]: {"a1"}, keys[3]: {"a1"}, keys[4]: {"a1"},
		k8[0]: {"a2"}, k8[1]: {"a2"}, k8[2]: {"a2"}})
	if got := pl.outcomes(aborted); len(got) != 2 || got[k8[0]] != sink.Aborted || got[k8[1]] != sink.Aborted {
		t.Fatalf("decisions at %d: %v, want each of the aborted attempt's effects Aborted", aborted, got)
	}
	if calls := pl.callsOf(); len(calls) != 2 || !slices.Equal(calls[1], k8) {
		t.Fatalf("handler calls %v, want the re-run's in one", calls)
	}
}

func cloneHeader(h nats.Header) nats.Header {
	out := nats.Header{}
	for k, vs := range h {
		out[k] = slices.Clone(vs)
	}
	return out
}

// A replayed job's effects carry the keys of its origin: a packed
// message's leasehold.HeaderOrigin goes on each of its effects, which
// apply as they would alone, not set aside for keys naming another job.
func TestPackedReplayedJobCarriesOrigin(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pkorig", leasehold.StampCompact)
	r := start(t, js, pl.cfg)
	org := leasehold.OriginOf("pkorig", 0, 7)
	keys := []string{org.EffectKey(0), org.EffectKey(1), org.EffectKey(2)}
	h, body := pl.packed(keys, "r1", leasehold.JobMark{Job: 50, Attempt: 1, Effects: 3})
	org.SetHeader(h)
	seq := pl.publish(h, body)
	pl.wait(r, seq)
	pl.want(map[string][]string{keys[0]: {"r1"}, keys[1]: {"r1"}, keys[2]: {"r1"}})
	pl.mu.Lock()
	defer pl.mu.Unlock()
	if len(pl.calls) != 1 {
		t.Fatalf("%d handler calls, want 1", len(pl.calls))
	}
	for _, e := range pl.calls[0] {
		if o, ok, err := leasehold.OriginFromHeader(e.Header); !ok || err != nil || o != org {
			t.Errorf("effect %s: origin %v, %v, %v; want %v", e.Stamp.Key, o, ok, err, org)
		}
	}
}
