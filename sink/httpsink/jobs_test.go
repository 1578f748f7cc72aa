package httpsink_test

import (
	"context"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/sink/streamsink"
)

// jobEffect publishes effect i of attempt a of job j on subject, under
// epoch 1; final marks it the attempt's last (of n) on the subject.
func (e *env) jobEffect(subject string, j, a uint64, i, n int, final bool, after uint64) uint64 {
	e.t.Helper()
	m := leasehold.JobMark{Job: j, Attempt: a}
	if final {
		m.Effects, m.After = n, after
	}
	h := nats.Header{}
	m.SetHeader(h)
	return e.publish(subject, e.stamp(1, leasehold.EffectKey(e.prefix, 0, j, i)), []byte(subject), h)
}

// abort publishes the abort marker of attempt a of job j on subject.
func (e *env) abort(subject string, j, a uint64) uint64 {
	e.t.Helper()
	h := nats.Header{}
	leasehold.JobMark{Job: j, Attempt: a, Abort: true}.SetHeader(h)
	st := e.stamp(1, e.prefix+".0."+itoa(j)+".abort."+itoa(a))
	return e.publish(subject, st, nil, h)
}

func itoa(n uint64) string {
	b := []byte{}
	for {
		b = append([]byte{byte('0' + n%10)}, b...)
		if n /= 10; n == 0 {
			return string(b)
		}
	}
}

// A job's effects reach the relay in one call and are sent together; an
// aborted attempt sends nothing, its retry everything; effects of one
// subject reach the receiver in log order, those of two subjects side by
// side.
func TestJobRequestsAllOrNone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "aonhook")
	rc := newReceiver(t, httpsink.VerifierConfig{RequireRelay: true})
	e.barrier(1)
	// Job 10, attempt 1: two effects on "hook", then it fails.
	e.jobEffect("hook", 10, 1, 0, 0, false, 0)
	e.jobEffect("hook", 10, 1, 1, 0, false, 0)
	e.abort("hook", 10, 1)
	// Attempt 2 completes with three effects on "hook".
	e.jobEffect("hook", 10, 2, 0, 3, false, 0)
	e.jobEffect("hook", 10, 2, 1, 3, false, 0)
	e.jobEffect("hook", 10, 2, 2, 3, true, 0)
	// Job 11 completes with two effects on "mail" and one on "hook".
	e.jobEffect("mail", 11, 1, 0, 2, false, 0)
	e.jobEffect("mail", 11, 1, 1, 2, true, 0)
	last := e.jobEffect("hook", 11, 1, 2, 1, true, 10)
	tr := newTransport()
	defer tr.close()
	r, err := httpsink.New(httpsink.Config{URL: rc.URL, Coordinator: e.coord("relay-a"), Concurrency: 4, Transport: tr, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	// The runner under the relay's lock, as RunSink runs it, with its
	// calls recorded.
	var mu sync.Mutex
	var calls [][]string
	rcfg := e.runnerConfig()
	rcfg.BatchHandler = func(ctx context.Context, effects []sink.Effect) error {
		var keys []string
		for _, ef := range effects {
			keys = append(keys, ef.Stamp.Key)
		}
		mu.Lock()
		calls = append(calls, keys)
		mu.Unlock()
		return r.DeliverBatch(ctx, effects)
	}
	positions := make(chan *streamsink.Runner, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- r.Run(ctx, func(ctx context.Context) error {
			rn, err := streamsink.New(ctx, e.js, rcfg)
			if err != nil {
				return err
			}
			positions <- rn
			return rn.Run(ctx)
		})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	rn := <-positions
	if err := rn.WaitPosition(ctxFor(t, time.Minute), last); err != nil {
		t.Fatal(err)
	}
	key := func(j uint64, i int) string { return leasehold.EffectKey(e.prefix, 0, j, i) }
	want := map[string]int{key(10, 0): 1, key(10, 1): 1, key(10, 2): 1, key(11, 0): 1, key(11, 1): 1, key(11, 2): 1}
	rc.waitCalls(t, want)
	if got := rc.snapshot(); len(got) != len(want) {
		t.Errorf("the receiver saw %v, want each of %v once", got, want)
	}
	for k := range want {
		if n := tr.count(k); n != 1 {
			t.Errorf("%s was sent %d times, want once: the aborted attempt sends nothing", k, n)
		}
	}
	mu.Lock()
	together := false
	for _, c := range calls {
		if slices.Contains(c, key(10, 0)) && slices.Contains(c, key(10, 1)) && slices.Contains(c, key(10, 2)) {
			together = true
		}
	}
	mu.Unlock()
	if !together {
		t.Errorf("job 10's effects did not reach the relay in one call: %v", calls)
	}
	rc.mu.Lock()
	order := slices.Clone(rc.order)
	rc.mu.Unlock()
	pos := map[string]int{}
	for i, k := range order {
		pos[k] = i
	}
	for _, pair := range [][2]string{{key(10, 0), key(10, 1)}, {key(10, 1), key(10, 2)}, {key(10, 2), key(11, 2)}, {key(11, 0), key(11, 1)}} {
		if pos[pair[0]] > pos[pair[1]] {
			t.Errorf("%s reached the receiver after %s: effects of one subject go in log order (%v)", pair[0], pair[1], order)
		}
	}
}

// DeliverBatch sends a job's effects in one call; when one fails, the
// effects the receiver took are not sent again when the runner hands the
// batch over one effect at a time.
func TestBatchFailureSendsTakenOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "batchonce")
	rc := newReceiver(t, httpsink.VerifierConfig{})
	rc.answer = func(w http.ResponseWriter, r *http.Request, st leasehold.Stamp, n int) bool {
		if st.Key == "k2" && n == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return true
		}
		return false
	}
	tr := newTransport()
	defer tr.close()
	r, err := httpsink.New(httpsink.Config{URL: rc.URL, Coordinator: e.coord("relay-a"), Transport: tr, Concurrency: 1, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctxFor(t, time.Minute))
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx, nil) }()
	effects := []sink.Effect{effect(e.stamp(1, "k1"), "a", "1"), effect(e.stamp(1, "k2"), "a", "2"), effect(e.stamp(1, "k3"), "a", "3")}
	if err := r.DeliverBatch(ctx, effects); err == nil {
		t.Fatal("the batch with a 503 in it succeeded")
	}
	for _, ef := range effects {
		if err := r.Deliver(ctx, ef); err != nil {
			t.Fatalf("%s alone: %v", ef.Stamp.Key, err)
		}
	}
	if n := tr.count("k1"); n != 1 {
		t.Errorf("k1, taken in the failed batch, was sent %d times", n)
	}
	if n := tr.count("k2"); n != 2 {
		t.Errorf("k2 was sent %d times, want twice (refused, then alone)", n)
	}
	if n := tr.count("k3"); n != 1 {
		t.Errorf("k3, never sent in the batch that stopped at k2, was sent %d times", n)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
