package wmstamp_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
	"github.com/leasehold/leasehold/worker/wmstamp"
)

// Publishing no message publishes nothing and is no error, as it is for
// Watermill's own publishers.
func TestPublishNoMessages(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	defer pubsub.Close()
	if err := wmstamp.NewPublisher(pubsub, wmstamp.Config{}).Publish("out"); err != nil {
		t.Fatalf("Publish with no messages: %v", err)
	}
}

// flaky is a Watermill publisher whose first calls fail, as a broker that
// is away would.
type flaky struct {
	message.Publisher
	mu    sync.Mutex
	fails int
	sent  []*message.Message // every message published
}

var errAway = errors.New("the broker is away")

func (f *flaky) Publish(topic string, msgs ...*message.Message) error {
	f.mu.Lock()
	fail := f.fails > 0
	if fail {
		f.fails--
	}
	f.mu.Unlock()
	if fail {
		return errAway
	}
	f.mu.Lock()
	f.sent = append(f.sent, msgs...)
	f.mu.Unlock()
	return nil
}

// A publish that fails fails the job's attempt even when the handler
// ignores the error, and the rest of the attempt's publishes are refused:
// the job runs again, and what reaches the topic carries the keys of a run
// that published everything, never a key shifted by a retry.
func TestFailedPublishFailsTheAttempt(t *testing.T) {
	fl := &flaky{fails: 1}
	pub := wmstamp.NewPublisher(fl, wmstamp.Config{})
	var mu sync.Mutex
	var attempts []int
	var refused error
	var want []string
	done := make(chan struct{})
	runWorker(t, 1, nil, func(ctx context.Context, j *worker.Job) error {
		mu.Lock()
		attempts = append(attempts, j.Attempt)
		mu.Unlock()
		first := pub.Publish("out", message.NewMessageWithContext(ctx, "first", []byte("1")))
		if first != nil {
			// A handler that retries at once, then gives up and returns
			// nil: the attempt must fail all the same.
			refused = pub.Publish("out", message.NewMessageWithContext(ctx, "first", []byte("1")))
			_ = pub.Publish("out", message.NewMessageWithContext(ctx, "second", []byte("2")))
			return nil
		}
		if err := pub.Publish("out", message.NewMessageWithContext(ctx, "second", []byte("2"))); err != nil {
			return err
		}
		for i := range 2 {
			want = append(want, leasehold.EffectKey("wm", j.Partition, j.Seq, i))
		}
		return nil
	}, done, func(c *worker.Config) {
		// The first attempt that succeeds ends the test: with a failed
		// publish that did not fail it, the first.
		var once sync.Once
		c.Observer = worker.ObserverFunc(func(_ context.Context, e worker.Event) {
			if e.Kind == worker.EventJobFinished {
				once.Do(func() { close(done) })
			}
		})
	})
	if len(attempts) != 2 || attempts[1] != 2 {
		t.Fatalf("attempts %v: the failed publish did not fail the first attempt", attempts)
	}
	if !errors.Is(refused, errAway) || !strings.Contains(refused.Error(), "earlier publish") {
		t.Fatalf("a publish after the failed one: %v; want it refused with the first failure", refused)
	}
	got := map[string]string{}
	for _, m := range fl.sent {
		got[m.Metadata.Get(leasehold.HeaderKey)] = m.UUID
	}
	if len(fl.sent) != 2 || got[want[0]] != "first" || got[want[1]] != "second" {
		t.Fatalf("published %v, want %s for first and %s for second, and nothing else", got, want[0], want[1])
	}
}
