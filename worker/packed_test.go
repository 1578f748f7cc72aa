package worker_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// wireMsg is one message of the effect log, read for a test of packing.
type wireMsg struct {
	subject string
	header  nats.Header
	data    []byte
	mark    leasehold.JobMark
	stamp   leasehold.Stamp
	pack    int // its HeaderPack count; 0 for a message of one effect
}

// effectLog reads e's effect log but for barriers, in log order.
func effectLog(t *testing.T, e *env) []wireMsg {
	t.Helper()
	var out []wireMsg
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		if isBarrier(m) {
			continue
		}
		w := wireMsg{subject: m.Subject(), header: m.Headers(), data: m.Data(), stamp: stampOf(t, m)}
		var err error
		if w.mark, err = leasehold.JobMarkFromHeader(w.header); err != nil {
			t.Fatalf("message on %s: %v", w.subject, err)
		}
		if w.pack, err = leasehold.PackCount(w.header); err != nil {
			t.Fatalf("message on %s: %v", w.subject, err)
		}
		out = append(out, w)
	}
	return out
}

// effects returns what m carries, one effect or several: its keys, data
// and own headers.
func (m wireMsg) effects(t *testing.T) []leasehold.PackedEffect {
	t.Helper()
	if m.pack == 0 {
		return []leasehold.PackedEffect{{Key: m.stamp.Key, Header: m.header, Data: m.data}}
	}
	es, err := leasehold.Unpack(m.data, m.pack)
	if err != nil {
		t.Fatalf("packed message on %s: %v", m.subject, err)
	}
	if last := es[len(es)-1].Key; last != m.stamp.Key {
		t.Errorf("packed message on %s: its last key %s is not its stamp's %s", m.subject, last, m.stamp.Key)
	}
	return es
}

// packConfig is e.config with packing on.
func (e *env) packConfig(name string, h worker.Handler) worker.Config {
	cfg := e.config(name, h)
	cfg.PackEffects = true
	return cfg
}

// With packing, a job of three effects on one subject and two on another,
// emitted in turns, sends one message on each: a pack of its effects
// there, in the order emitted, under the stamp of the last, marked as the
// attempt's final counting them; each effect keeps the headers its
// caller gave it, but for the worker's and the server's.
func TestPackedEffectsOnTheWire(t *testing.T) {
	e := newEnv(t, 1)
	out, extra := worker.OutputSubject(e.prefix, 0), e.prefix+".out.extra"
	rec := newRecorder()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		for i := range 5 {
			subject := out
			if i%2 == 1 {
				subject = extra
			}
			hdr := nats.Header{
				"X-Effect":             []string{fmt.Sprint(i)},
				"X-Two":                []string{"a", "b"},
				leasehold.HeaderStamp:  []string{"1 forged"},
				"leasehold-mark":       []string{"1 1 1"},
				"Leasehold-Pack":       []string{"1 9"},
				"Nats-Expected-Stream": []string{worker.EffectsStream(e.prefix)},
			}
			if err := j.Publish(ctx, subject, []byte(fmt.Sprintf("data-%d", i)), worker.EmitHeader(hdr)); err != nil {
				return err
			}
		}
		return nil
	})
	cfg := e.packConfig("w", h)
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, 1)
	rec.waitCommitted(t, time.Minute, enq[0].Seq)
	if n := rec.count(kind(worker.EventEffectEmitted)); n != 5 {
		t.Errorf("%d effect events, want one per effect, 5", n)
	}
	msgs := effectLog(t, e)
	if len(msgs) != 2 {
		t.Fatalf("%d messages, want one per subject, 2", len(msgs))
	}
	seq := enq[0].Seq
	want := map[string][]int{out: {0, 2, 4}, extra: {1, 3}}
	for _, m := range msgs {
		idx := want[m.subject]
		if m.pack != len(idx) {
			t.Errorf("%s: packs %d effects, want %d", m.subject, m.pack, len(idx))
		}
		if mk := m.mark; mk.Job != seq || mk.Effects != len(idx) || mk.After != 0 || mk.Abort {
			t.Errorf("%s: mark %+v, want the final of job %d counting %d effects", m.subject, mk, seq, len(idx))
		}
		if id := m.header.Get(jetstream.MsgIDHeader); !strings.HasPrefix(id, m.stamp.Key+"@") {
			t.Errorf("%s: message ID %q, want the last effect's", m.subject, id)
		}
		for _, eff := range m.effects(t) {
			i := idx[0]
			idx = idx[1:]
			if k := leasehold.EffectKey(e.prefix, 0, seq, i); eff.Key != k {
				t.Errorf("%s: effect key %s, want %s", m.subject, eff.Key, k)
			}
			if d := fmt.Sprintf("data-%d", i); string(eff.Data) != d {
				t.Errorf("%s: effect %s: data %q, want %q", m.subject, eff.Key, eff.Data, d)
			}
			got := nats.Header(eff.Header)
			if got.Get("X-Effect") != fmt.Sprint(i) || strings.Join(got.Values("X-Two"), ",") != "a,b" {
				t.Errorf("%s: effect %s: headers %v, want the caller's", m.subject, eff.Key, eff.Header)
			}
			if m.pack == 0 {
				continue
			}
			for name := range eff.Header {
				if leasehold.IsStampHeader(name) || strings.EqualFold(name, leasehold.HeaderPack) || strings.HasPrefix(strings.ToLower(name), "nats-") {
					t.Errorf("%s: effect %s carries header %s, the worker's or the server's", m.subject, eff.Key, name)
				}
			}
		}
	}
}

// A job of one effect on each subject sends each as it does without
// packing: a plain message, marked final, with no HeaderPack.
func TestPackedOneEffectIsPlain(t *testing.T) {
	e := newEnv(t, 1)
	out, extra := worker.OutputSubject(e.prefix, 0), e.prefix+".out.extra"
	rec := newRecorder()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		if err := j.Publish(ctx, out, []byte("one"), worker.EmitHeader(nats.Header{"X-User": []string{"u"}})); err != nil {
			return err
		}
		return j.Publish(ctx, extra, []byte("two"))
	})
	cfg := e.packConfig("w", h)
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, 1)
	rec.waitCommitted(t, time.Minute, enq[0].Seq)
	msgs := effectLog(t, e)
	if len(msgs) != 2 {
		t.Fatalf("%d messages, want 2", len(msgs))
	}
	for i, m := range msgs {
		if _, ok := m.header[leasehold.HeaderPack]; ok || m.pack != 0 {
			t.Errorf("%s: a message of one effect carries %s", m.subject, leasehold.HeaderPack)
		}
		if mk := m.mark; mk.Job != enq[0].Seq || mk.Effects != 1 || mk.Abort {
			t.Errorf("%s: mark %+v, want the final of job %d counting 1 effect", m.subject, mk, enq[0].Seq)
		}
		if k := leasehold.EffectKey(e.prefix, 0, enq[0].Seq, i); m.stamp.Key != k {
			t.Errorf("%s: key %s, want %s", m.subject, m.stamp.Key, k)
		}
	}
	if msgs[0].header.Get("X-User") != "u" || string(msgs[0].data) != "one" || string(msgs[1].data) != "two" {
		t.Errorf("messages %+v, %+v: not the effects as emitted", msgs[0], msgs[1])
	}
}

// bigEffect is data that a packed message can hold two of, and not three.
func bigEffect(t *testing.T, e *env, b byte) []byte {
	t.Helper()
	limit := e.js.Conn().MaxPayload()
	return bytes.Repeat([]byte{b}, int(limit/3+limit/12))
}

// An attempt that fails after what it held had to leave early (two
// effects too large for one message) closes the subject with an abort
// marker; one that fails while it still holds everything sends nothing
// on the subject, not even an abort marker.
func TestPackedFailedAttempt(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		switch string(j.Data) {
		case "key-0": // leaves early, then fails
			for i := range 2 {
				if err := j.Emit(ctx, bigEffect(t, e, byte('a'+i))); err != nil {
					return err
				}
			}
			for range 2 {
				if err := j.Emit(ctx, bigEffect(t, e, 'x')); err != nil {
					return err
				}
			}
		case "key-1": // holds everything, then fails
			for i := range 3 {
				if err := j.Emit(ctx, []byte(fmt.Sprint(i))); err != nil {
					return err
				}
			}
		}
		if j.Attempt == 1 {
			return errors.New("fails after its effects")
		}
		return nil
	})
	cfg := e.packConfig("w", h)
	cfg.Observer = rec
	cfg.Order = worker.OrderPartition
	start(t, cfg)
	enq := e.enqueue(t, 0, 2)
	rec.waitCommitted(t, time.Minute, enq[1].Seq)
	var attempts [2][]leasehold.JobMark
	for _, m := range effectLog(t, e) {
		for i := range enq {
			if m.mark.Job == enq[i].Seq {
				attempts[i] = append(attempts[i], m.mark)
			}
		}
	}
	// key-0: its first attempt sends its first two effects packed when
	// the third would not fit with them, and holds the third and fourth:
	// it fails, so an abort marker follows the early ones.
	a0 := attempts[0]
	if len(a0) < 2 || a0[0].Final() || a0[0].Abort || !a0[1].Abort || a0[1].Attempt != a0[0].Attempt {
		t.Errorf("job 0 failing after an early send: %+v, want an effect of attempt 1 then its abort marker", a0)
	}
	for _, mk := range a0 {
		if mk.Attempt == a0[0].Attempt && mk.Final() {
			t.Errorf("job 0: the failed attempt sent a final: %+v", a0)
		}
	}
	// key-1: its failed attempt left nothing; its retry one packed final.
	a1 := attempts[1]
	if len(a1) != 1 || a1[0].Effects != 3 {
		t.Errorf("job 1: %+v, want one final of 3 effects and nothing of the failed attempt", a1)
	}
	if n := rec.count(func(ev worker.Event) bool { return ev.Kind == worker.EventJobFailed && ev.Seq == enq[1].Seq }); n != 1 {
		t.Errorf("job 1 failed %d times, want once", n)
	}
}

// Effects that do not fit in one message together leave in several: each
// holds what fits, all but the last under the plain mark, the last the
// attempt's final counting every effect, and none above the server's max
// payload.
func TestPackedBudget(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	const effects = 7
	limit := e.js.Conn().MaxPayload()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		for i := range effects {
			// 300 KiB, then a small one, in turns: three large ones fit in
			// 1 MiB with the small ones between, a fourth does not.
			data := []byte(fmt.Sprint(i))
			if i%2 == 0 {
				data = bytes.Repeat([]byte{byte('a' + i)}, int(limit*3/10))
			}
			if err := j.Emit(ctx, data); err != nil {
				return err
			}
		}
		return nil
	})
	cfg := e.packConfig("w", h)
	cfg.Observer = rec
	start(t, cfg)
	enq := e.enqueue(t, 0, 1)
	rec.waitCommitted(t, time.Minute, enq[0].Seq)
	msgs := effectLog(t, e)
	// The first six (three large) fit in one message, the seventh (a
	// fourth large one) does not fit with them.
	if len(msgs) != 2 || msgs[0].pack != 6 || msgs[1].pack != 0 {
		t.Errorf("%d messages, want 2: six effects packed, then the seventh alone", len(msgs))
	}
	next := 0
	for i, m := range msgs {
		last := i == len(msgs)-1
		if m.mark.Final() != last {
			t.Errorf("message %d of %d: mark %+v: only the last is final", i, len(msgs), m.mark)
		}
		if last && m.mark.Effects != effects {
			t.Errorf("final %+v counts %d effects, want %d", m.mark, m.mark.Effects, effects)
		}
		if size := int64(len(m.data) + headerBytes(m.header)); size > limit {
			t.Errorf("message %d: %d bytes, above the max payload %d", i, size, limit)
		}
		for _, eff := range m.effects(t) {
			if k := leasehold.EffectKey(e.prefix, 0, enq[0].Seq, next); eff.Key != k {
				t.Errorf("message %d: effect %s, want %s", i, eff.Key, k)
			}
			next++
		}
	}
	if next != effects {
		t.Errorf("the messages carry %d effects, want %d", next, effects)
	}
}

// PackEffects with the legacy stamp is refused.
func TestPackedNeedsCompactStamp(t *testing.T) {
	e := newEnv(t, 1)
	cfg := e.packConfig("w", worker.HandlerFunc(func(context.Context, *worker.Job) error { return nil }))
	cfg.StampFormat = leasehold.StampLegacy
	err := cfg.Validate()
	if err == nil || !strings.Contains(err.Error(), "PackEffects") {
		t.Fatalf("Validate: %v, want PackEffects with StampLegacy refused", err)
	}
	_, err = worker.NewInMemory(cfg, leasehold.Lease{Scope: e.prefix, Epoch: 1, Acquisition: "a1", Holder: "w"})
	if err == nil || !strings.Contains(err.Error(), "PackEffects") {
		t.Fatalf("NewInMemory: %v, want PackEffects with StampLegacy refused", err)
	}
}

// headerBytes is the size of h on the wire.
func headerBytes(h nats.Header) int {
	n := len("NATS/1.0\r\n\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(": \r\n") + len(v)
		}
	}
	return n
}

// With packing, an effect whose header name no packed body could carry
// (not an RFC 9110 token) is refused when it is emitted, as permanent:
// packed, it would make a sink refuse every effect beside it.
func TestPackedRefusesHeaderNamesNotTokens(t *testing.T) {
	var emitErr error
	m, err := worker.NewInMemory(worker.Config{
		Prefix: "jobs", Partitions: 1, PackEffects: true, MaxAttempts: 3, Logger: testLogger(),
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			if err := j.Emit(ctx, []byte("fine")); err != nil {
				return err
			}
			emitErr = j.Emit(ctx, []byte("bad"), worker.EmitHeader(nats.Header{"Bad Name": []string{"v"}}))
			return emitErr
		}),
	}, leasehold.Lease{Scope: "jobs", Epoch: 1, Acquisition: "a1", Holder: "w"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxFor(t, time.Minute)
	if _, err := m.Producer().Enqueue(ctx, []byte("k"), []byte("x")); err != nil {
		t.Fatal(err)
	}
	res, ok := m.Next(ctx)
	if !ok {
		t.Fatal("no job ran")
	}
	if !worker.IsPermanent(emitErr) || !strings.Contains(fmt.Sprint(emitErr), "Bad Name") {
		t.Errorf("emit with header \"Bad Name\": %v, want a permanent error naming it", emitErr)
	}
	if res.Done || res.DeadLetter == nil || len(res.Attempts) != 1 {
		t.Errorf("the job: done %v, dead letter %v, %d attempts; want it dead-lettered after one", res.Done, res.DeadLetter != nil, len(res.Attempts))
	}
	for _, a := range res.Attempts {
		for _, msg := range a.Published {
			if mk, _ := leasehold.JobMarkFromHeader(msg.Header); !mk.Standalone() {
				t.Errorf("the attempt sent %+v: it held everything and failed", mk)
			}
		}
	}
}

// A job stored again elsewhere (a move, a replay) packs its effects under
// its origin's keys: the packed message carries the origin, as an effect
// alone does, and its effects carry none of their own.
func TestPackedEffectsOfAMovedJob(t *testing.T) {
	e := newEnv(t, 1)
	rec := newRecorder()
	cfg := e.packConfig("w", emitN(3))
	cfg.Observer = rec
	start(t, cfg)
	msg := nats.NewMsg(worker.JobSubject(e.prefix, 0))
	msg.Data = []byte("moved")
	msg.Header.Set(leasehold.HeaderOrigin, "old/0/77")
	ack, err := e.js.PublishMsg(ctxFor(t, 30*time.Second), msg)
	if err != nil {
		t.Fatal(err)
	}
	rec.waitCommitted(t, time.Minute, ack.Sequence)
	msgs := effectLog(t, e)
	if len(msgs) != 1 || msgs[0].pack != 3 {
		t.Fatalf("%d messages (%+v), want one packing 3 effects", len(msgs), msgs)
	}
	m := msgs[0]
	if o := m.header.Get(leasehold.HeaderOrigin); o != "old/0/77" {
		t.Errorf("the packed message's origin %q, want old/0/77", o)
	}
	for i, eff := range m.effects(t) {
		if k := leasehold.EffectKey("old", 0, 77, i); eff.Key != k {
			t.Errorf("effect %d: key %s, want the origin's %s", i, eff.Key, k)
		}
		for name := range eff.Header {
			if strings.EqualFold(name, leasehold.HeaderOrigin) {
				t.Errorf("effect %s carries %s of its own", eff.Key, name)
			}
		}
	}
}

// With packing, an effect whose own headers no stream would take in a
// message's headers is refused when it is emitted, as too large and
// permanent: in a packed body the server does not see them, and a sink
// would refuse the whole pack.
func TestPackedRefusesHeadersAStreamWouldNot(t *testing.T) {
	var emitErr error
	m, err := worker.NewInMemory(worker.Config{
		Prefix: "jobs", Partitions: 1, PackEffects: true, Logger: testLogger(),
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			if err := j.Emit(ctx, []byte("fine"), worker.EmitHeader(nats.Header{"Baggage": {strings.Repeat("b", 60_000)}})); err != nil {
				return err
			}
			emitErr = j.Emit(ctx, []byte("big"), worker.EmitHeader(nats.Header{"Baggage": {strings.Repeat("b", 62_000)}}))
			return emitErr
		}),
	}, leasehold.Lease{Scope: "jobs", Epoch: 1, Acquisition: "a1", Holder: "w"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxFor(t, time.Minute)
	if _, err := m.Producer().Enqueue(ctx, []byte("k"), []byte("x")); err != nil {
		t.Fatal(err)
	}
	res, ok := m.Next(ctx)
	if !ok {
		t.Fatal("no job ran")
	}
	if !worker.IsPermanent(emitErr) || !errors.Is(emitErr, worker.ErrEffectTooLarge) {
		t.Errorf("emit with 62 KB of headers: %v, want a permanent error matching ErrEffectTooLarge", emitErr)
	}
	if res.Done || res.DeadLetter == nil {
		t.Errorf("the job: done %v, dead letter %v; want it dead-lettered", res.Done, res.DeadLetter != nil)
	}
}
