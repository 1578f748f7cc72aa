package wmstamp

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// Lease is what a publisher stamps messages outside a job with: the lease's
// value, why it is no longer held, and its local deadline (zero: none).
// *coordinator.Lease satisfies it.
type Lease interface {
	Info() leasehold.Lease
	Err() error
	Deadline() time.Time
}

// usable reports why l may no longer be written under: the lease is lost
// or its local deadline has passed, read from the clock now rather than
// from the deadline's timer, which a process frozen past it has not run
// yet when it wakes.
func usable(l Lease) error {
	if err := l.Err(); err != nil {
		if errors.Is(err, leasehold.ErrLeaseLost) {
			return fmt.Errorf("wmstamp: %w", err)
		}
		return fmt.Errorf("wmstamp: %w (%w)", leasehold.ErrLeaseLost, err)
	}
	if d := l.Deadline(); !d.IsZero() && !time.Now().Before(d) {
		return fmt.Errorf("wmstamp: %w: the lease's local deadline passed %v ago", leasehold.ErrLeaseLost, time.Since(d).Round(time.Millisecond))
	}
	return nil
}

// input numbers the messages published while one Watermill message is
// handled (see Middleware).
type input struct {
	id string

	mu   sync.Mutex
	next int
}

type inputKey struct{}

func inputFrom(ctx context.Context) *input {
	in, _ := ctx.Value(inputKey{}).(*input)
	return in
}

// Middleware is a Watermill HandlerMiddleware that gives the messages a
// handler publishes through a stamping publisher with Config.Lease keys
// derived from the message it handles: its Leasehold-Key when it carries a
// stamp, its UUID otherwise, and the index of each message in publishing
// order. Handling the same message again (a redelivery, a retry) then
// gives its messages the same keys, so a deduping sink applies each once.
// It covers the messages the handler returns and those it publishes itself
// with the handled message's context (message.NewMessageWithContext(
// msg.Context(), ...)). Put it inside middleware.Retry, so that each retry
// numbers from the start.
//
// Without Middleware, a message stamped with a lease is keyed by its own
// UUID.
func Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		id := msg.UUID
		if s, err := leasehold.StampFromMetadata(msg.Metadata); err == nil {
			id = s.Key
		}
		in := &input{id: id}
		msg.SetContext(context.WithValue(msg.Context(), inputKey{}, in))
		out, err := h(msg)
		for _, m := range out {
			if m != nil && worker.JobFromContext(m.Context()) == nil && inputFrom(m.Context()) == nil {
				m.SetContext(context.WithValue(m.Context(), inputKey{}, in))
			}
		}
		return out, err
	}
}

// leaseKey is the idempotency key of a message stamped under lease l: the
// index-th of those published while handling input id, or, with index
// -1, the message whose UUID is id. A key beyond leasehold.MaxKeyLen takes
// a digest of id instead.
func leaseKey(l leasehold.Lease, id string, index int) string {
	build := func(id string) string {
		k := l.Scope + "." + l.Partition.String() + ".wm." + id
		if index >= 0 {
			k += "." + strconv.Itoa(index)
		}
		return k
	}
	k := build(id)
	if len(k) > leasehold.MaxKeyLen {
		sum := sha256.Sum256([]byte(id))
		k = build(hex.EncodeToString(sum[:16]))
	}
	return k
}

// reservation is the keys one publish took from an input, given back if
// the publish fails.
type reservation struct {
	in         *input
	start, end int
}

// publishLeased stamps msgs with the publisher's lease and publishes them
// in one call of the wrapped publisher. A failed call takes back the keys
// it reserved, so that publishing the same messages again gives them the
// same keys.
func (p *Publisher) publishLeased(topic string, msgs []*message.Message) error {
	if err := usable(p.lease); err != nil {
		return fmt.Errorf("%w: %d messages to %s not published", err, len(msgs), topic)
	}
	l := p.lease.Info()
	var res []reservation
	stamps := make([]leasehold.Stamp, len(msgs))
	for i, m := range msgs {
		in := inputFrom(m.Context())
		if in == nil {
			stamps[i] = l.Stamp(leaseKey(l, m.UUID, -1))
			continue
		}
		in.mu.Lock()
		n := in.next
		in.next++
		in.mu.Unlock()
		if len(res) > 0 && res[len(res)-1].in == in && res[len(res)-1].end == n {
			res[len(res)-1].end = n + 1
		} else {
			res = append(res, reservation{in: in, start: n, end: n + 1})
		}
		stamps[i] = l.Stamp(leaseKey(l, in.id, n))
	}
	err := p.sendLeased(topic, msgs, stamps)
	if err != nil {
		// Give the keys back where nothing was reserved after them, the
		// usual case of one goroutine handling one message.
		for i := len(res) - 1; i >= 0; i-- {
			r := res[i]
			r.in.mu.Lock()
			if r.in.next == r.end {
				r.in.next = r.start
			}
			r.in.mu.Unlock()
		}
		return err
	}
	p.tel.Metrics.EffectsEmitted.Add(msgs[0].Context(), int64(len(msgs)))
	return nil
}

func (p *Publisher) sendLeased(topic string, msgs []*message.Message, stamps []leasehold.Stamp) error {
	for i, s := range stamps {
		if err := s.Validate(); err != nil {
			return fmt.Errorf("wmstamp: message %s to %s: %w", msgs[i].UUID, topic, err)
		}
	}
	spans := make([]trace.Span, len(msgs))
	for i, m := range msgs {
		spans[i] = p.stamp(m, topic, stamps[i])
	}
	// The last look before the messages leave: a process frozen since
	// they were stamped must not send them now.
	err := usable(p.lease)
	if err == nil {
		if err = p.pub.Publish(topic, msgs...); err != nil {
			err = fmt.Errorf("wmstamp: publish %d messages to %s: %w", len(msgs), topic, err)
		}
	}
	for _, s := range spans {
		endSend(s, err)
	}
	return err
}
