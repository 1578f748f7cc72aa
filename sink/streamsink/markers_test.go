package streamsink_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// markerWorld is a job stream of one partition, a worker running a test's
// handler on it, and a stream sink runner that verifies epochs and reads
// committed progress from the worker's lease bucket, as `leasehold sink`
// runs it. What the runner's Handler accepts is recorded by key, with the
// data of each accepted delivery; refuse, when set, may refuse one.
type markerWorld struct {
	t      *testing.T
	js     jetstream.JetStream
	prefix string
	sink   *running
	cfg    streamsink.Config
	reader *sdkmetric.ManualReader

	mu        sync.Mutex
	applied   map[string][]string
	decisions []sink.Decision
	refuse    func(sink.Effect) error
	committed uint64

	events   chan worker.Event
	acquired chan leasehold.Lease
	progress chan struct{} // signalled on every commit
}

func (mw *markerWorld) handler(_ context.Context, e sink.Effect) error {
	mw.mu.Lock()
	defer mw.mu.Unlock()
	if mw.refuse != nil {
		if err := mw.refuse(e); err != nil {
			return err
		}
	}
	mw.applied[e.Stamp.Key] = append(mw.applied[e.Stamp.Key], string(e.Data))
	return nil
}

func (mw *markerWorld) Decided(_ context.Context, d sink.Decision) {
	mw.mu.Lock()
	mw.decisions = append(mw.decisions, d)
	mw.mu.Unlock()
}

func (mw *markerWorld) WorkerEvent(_ context.Context, e worker.Event) {
	switch e.Kind {
	case worker.EventPartitionAcquired:
		select {
		case mw.acquired <- e.Lease:
		default:
		}
	case worker.EventProgressCommitted:
		mw.mu.Lock()
		mw.committed = max(mw.committed, e.Seq)
		mw.mu.Unlock()
		select {
		case mw.progress <- struct{}{}:
		default:
		}
	}
	select {
	case mw.events <- e:
	default:
	}
}

// newMarkerWorld starts the world on one server or on a three-node
// cluster; tune adjusts the runner's configuration.
func newMarkerWorld(t *testing.T, topo, prefix string, maxAttempts int, tune func(*streamsink.Config), h worker.HandlerFunc) *markerWorld {
	t.Helper()
	return newMarkerWorldOrdered(t, topo, prefix, maxAttempts, tune, worker.OrderKey, h)
}

// newMarkerWorldOrdered is newMarkerWorld with a worker that keeps order.
func newMarkerWorldOrdered(t *testing.T, topo, prefix string, maxAttempts int, tune func(*streamsink.Config), order worker.Order, h worker.HandlerFunc) *markerWorld {
	t.Helper()
	js, replicas := startTopo(t, topo)
	bucket := provisionJobs(t, js, prefix, replicas)
	mw := &markerWorld{t: t, js: js, prefix: prefix, applied: map[string][]string{}, reader: sdkmetric.NewManualReader(),
		events: make(chan worker.Event, 4096), acquired: make(chan leasehold.Lease, 1), progress: make(chan struct{}, 1)}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(mw.reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	mw.cfg = streamsink.Config{Prefix: prefix, Replicas: replicas, Handler: mw.handler, Verifier: bucket, Observer: mw,
		MaxBackoff: 10 * time.Millisecond, Logger: quiet(), Name: prefix, Telemetry: telemetry.Config{MeterProvider: mp}}
	if tune != nil {
		tune(&mw.cfg)
	}
	mw.sink = start(t, js, mw.cfg)
	cfg := workerConfig(js, prefix, bucket, "w1", h)
	cfg.Coordinator.TTL = 5 * time.Second
	cfg.MaxAttempts, cfg.Observer, cfg.Order = maxAttempts, mw, order
	runWorker(t, cfg)
	return mw
}

// lease waits for the worker to be handed the partition and for its
// barrier to be in the effect log, and returns the lease.
func (mw *markerWorld) lease() leasehold.Lease {
	mw.t.Helper()
	var l leasehold.Lease
	select {
	case l = <-mw.acquired:
	case <-time.After(time.Minute):
		mw.t.Fatal("the worker was not handed the partition within a minute")
	}
	mw.find(func(m *jetstream.RawStreamMsg) bool {
		st, err := leasehold.StampFromHeader(m.Header)
		return m.Header.Get(leasehold.HeaderBarrier) != "" && err == nil && st.Epoch == l.Epoch
	})
	return l
}

func (mw *markerWorld) enqueue(body string) uint64 {
	mw.t.Helper()
	p := producerOf(mw.t, mw.js, mw.prefix)
	e, err := p.Enqueue(ctxFor(mw.t, 30*time.Second), []byte(body), []byte(body))
	if err != nil {
		mw.t.Fatal(err)
	}
	return e.Seq
}

// awaitCommitted waits until the worker has committed progress through seq.
func (mw *markerWorld) awaitCommitted(seq uint64) {
	mw.t.Helper()
	deadline := time.After(time.Minute)
	for {
		mw.mu.Lock()
		done := mw.committed >= seq
		mw.mu.Unlock()
		if done {
			return
		}
		select {
		case <-mw.progress:
		case <-deadline:
			mw.t.Fatalf("the worker did not commit job %d within a minute", seq)
		}
	}
}

// find reads the effect log in order, waiting for what is not there yet,
// until match holds for a message, and returns it.
func (mw *markerWorld) find(match func(*jetstream.RawStreamMsg) bool) *jetstream.RawStreamMsg {
	mw.t.Helper()
	ctx := ctxFor(mw.t, time.Minute)
	s, err := mw.js.Stream(ctx, worker.EffectsStream(mw.prefix))
	if err != nil {
		mw.t.Fatal(err)
	}
	c, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		mw.t.Fatal(err)
	}
	for {
		m, err := c.Next(jetstream.FetchMaxWait(time.Second))
		if ctx.Err() != nil {
			mw.t.Fatal("the message looked for was not in the effect log within a minute")
		}
		if err != nil {
			continue
		}
		md, err := m.Metadata()
		if err != nil {
			mw.t.Fatal(err)
		}
		raw := &jetstream.RawStreamMsg{Subject: m.Subject(), Sequence: md.Sequence.Stream, Header: m.Headers(), Data: m.Data()}
		if match(raw) {
			return raw
		}
	}
}

// effectOf waits for effect i of job seq in the log.
func (mw *markerWorld) effectOf(seq uint64, i int) *jetstream.RawStreamMsg {
	key := leasehold.EffectKey(mw.prefix, 0, seq, i)
	return mw.find(func(m *jetstream.RawStreamMsg) bool {
		st, err := leasehold.StampFromHeader(m.Header)
		return err == nil && st.Key == key
	})
}

// publish stores a message in the effect log and returns its position.
func (mw *markerWorld) publish(subject string, h nats.Header, data []byte) uint64 {
	mw.t.Helper()
	ack, err := mw.js.PublishMsg(ctxFor(mw.t, 30*time.Second), &nats.Msg{Subject: subject, Header: h, Data: data})
	if err != nil {
		mw.t.Fatal(err)
	}
	return ack.Sequence
}

// forge stores a copy of m's stamp and trace headers with mark and data.
func (mw *markerWorld) forge(m *jetstream.RawStreamMsg, mark leasehold.JobMark, data []byte) uint64 {
	mw.t.Helper()
	h := nats.Header{}
	for k, vs := range m.Header {
		if strings.HasPrefix(k, "Leasehold-") {
			h[k] = vs
		}
	}
	mark.SetHeader(h)
	return mw.publish(m.Subject, h, data)
}

// settle waits until the runner has decided the whole effect log.
func (mw *markerWorld) settle() {
	mw.t.Helper()
	settleLog(mw.t, mw.js, mw.prefix, mw.sink)
}

// awaitApplied waits until every key in want has been applied, then
// checks that each was applied exactly once, with the data given.
func (mw *markerWorld) awaitApplied(want map[string]string) {
	mw.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		mw.mu.Lock()
		missing := ""
		for k := range want {
			if len(mw.applied[k]) == 0 {
				missing = k
				break
			}
		}
		mw.mu.Unlock()
		if missing == "" {
			break
		}
		if time.Now().After(deadline) {
			mw.mu.Lock()
			defer mw.mu.Unlock()
			mw.t.Fatalf("effect %s of a committed job was not applied within a minute (applied: %v; decisions: %s)", missing, mw.applied, mw.describe())
		}
		// The runner applies what waited for the fence record on its
		// next read of it; the settle below then covers the rest.
		time.Sleep(20 * time.Millisecond)
	}
	mw.settle()
	mw.mu.Lock()
	defer mw.mu.Unlock()
	for k, data := range want {
		if got := mw.applied[k]; len(got) != 1 || got[0] != data {
			mw.t.Errorf("effect %s applied as %q, want once as %q", k, got, data)
		}
	}
}

// describe lists the decisions; mw.mu is held.
func (mw *markerWorld) describe() string {
	var b strings.Builder
	for _, d := range mw.decisions {
		fmt.Fprintf(&b, "\n  %d %s %s suspect=%q: %v", d.Position, d.Stamp.Key, d.Outcome, d.Suspect, d.Err)
	}
	return b.String()
}

// decisionAt returns the decision reported for log position pos.
func (mw *markerWorld) decisionAt(pos uint64) (sink.Decision, bool) {
	mw.mu.Lock()
	defer mw.mu.Unlock()
	for _, d := range mw.decisions {
		if d.Position == pos {
			return d, true
		}
	}
	return sink.Decision{}, false
}

// suspicious reads leasehold.sink.markers.suspicious for reason.
func (mw *markerWorld) suspicious(reason string) int64 {
	mw.t.Helper()
	var n int64
	eachPoint(mw.t, mw.reader, "leasehold.sink.markers.suspicious", func(p metricdata.DataPoint[int64]) {
		if v, _ := p.Attributes.Value(telemetry.AttrReason); v.AsString() == reason {
			n += p.Value
		}
	})
	return n
}

// wantSuspect checks that the message at pos was set aside for reason,
// and counted.
func (mw *markerWorld) wantSuspect(pos uint64, reason string) {
	mw.t.Helper()
	d, ok := mw.decisionAt(pos)
	if !ok || d.Suspect != reason {
		mw.t.Errorf("the forged message at position %d: decision %v (reported %v, suspect %q), want it set aside as %s", pos, d.Outcome, ok, d.Suspect, reason)
	}
	if n := mw.suspicious(reason); n < 1 {
		mw.t.Errorf("leasehold.sink.markers.suspicious{reason=%s} is %d, want at least 1", reason, n)
	}
}

// blockingHandler emits n effects per attempt, data "<body>-<i>", and on
// the first attempt of each job waits, after emitting, until released.
type blockingHandler struct {
	n       int
	emitted chan uint64
	release chan struct{}
	mu      sync.Mutex
	seen    map[uint64]bool
}

func newBlockingHandler(n int) *blockingHandler {
	return &blockingHandler{n: n, emitted: make(chan uint64, 16), release: make(chan struct{}), seen: map[uint64]bool{}}
}

func (b *blockingHandler) Handle(ctx context.Context, j *worker.Job) error {
	for i := range b.n {
		if err := j.Emit(ctx, []byte(fmt.Sprintf("%s-%d", j.Data, i))); err != nil {
			return err
		}
	}
	b.mu.Lock()
	first := !b.seen[j.Seq]
	b.seen[j.Seq] = true
	b.mu.Unlock()
	if first {
		b.emitted <- j.Seq
		select {
		case <-b.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

func (mw *markerWorld) awaitEmitted(b *blockingHandler) uint64 {
	mw.t.Helper()
	select {
	case seq := <-b.emitted:
		return seq
	case <-time.After(time.Minute):
		mw.t.Fatal("the handler did not emit within a minute")
	}
	return 0
}

func (mw *markerWorld) wantKeys(seq uint64, n int, body string) map[string]string {
	want := map[string]string{}
	for i := range n {
		want[leasehold.EffectKey(mw.prefix, 0, seq, i)] = fmt.Sprintf("%s-%d", body, i)
	}
	return want
}
