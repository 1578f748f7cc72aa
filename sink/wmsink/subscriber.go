package wmsink

import (
	"context"
	"errors"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Subscriber returns a decorator that fences the messages of the
// subscriber it decorates as they arrive: a handler reading its channels
// gets only admitted effects, and barriers, refused and badly stamped
// messages are acked (see the package documentation). A message whose
// decision fails is nacked after a backoff. Each delivery is decided once:
// a Middleware of the same Fencer lets the decided message through, and
// the outcome (accepted, or failed when the handler nacks it) is reported
// when the message is acked or nacked.
//
// The decorated subscriber keeps the Watermill contract: it offers
// SubscribeInitialize when the subscriber it decorates does, and Close
// returns once every channel it handed out is closed; a message in hand
// then is nacked, never delivered.
func (f *Fencer) Subscriber() message.SubscriberDecorator {
	return func(sub message.Subscriber) (message.Subscriber, error) {
		if sub == nil {
			return nil, errors.New("wmsink: no subscriber to decorate")
		}
		s := &fenced{sub: sub, f: f, closing: make(chan struct{})}
		if init, ok := sub.(message.SubscribeInitializer); ok {
			return &fencedInitializer{fenced: s, init: init}, nil
		}
		return s, nil
	}
}

// fenced is the decorated subscriber.
type fenced struct {
	sub message.Subscriber
	f   *Fencer

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	wg      sync.WaitGroup // the subscriptions' goroutines and the watches
}

// fencedInitializer is fenced over a subscriber that initializes topics.
type fencedInitializer struct {
	*fenced
	init message.SubscribeInitializer
}

// SubscribeInitialize initializes topic in the decorated subscriber.
func (s *fencedInitializer) SubscribeInitialize(topic string) error {
	return s.init.SubscribeInitialize(topic)
}

var (
	_ message.Subscriber           = (*fenced)(nil)
	_ message.SubscribeInitializer = (*fencedInitializer)(nil)
)

// Subscribe subscribes to topic and returns a channel of its admitted
// messages, closed when ctx ends or the subscriber closes.
func (s *fenced) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errors.New("wmsink: the subscriber is closed")
	}
	s.wg.Add(1)
	s.mu.Unlock()
	in, err := s.sub.Subscribe(ctx, topic)
	if err != nil {
		s.wg.Done()
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer s.wg.Done()
		s.pump(ctx, in, out)
		close(out)
		// What the subscriber still hands over goes back to it, until it
		// closes its channel: it does when ctx ends or it is closed.
		for m := range in {
			m.Nack()
		}
	}()
	return out, nil
}

// pump decides the messages of in and forwards the admitted ones to out,
// until in closes, ctx ends or the subscriber closes.
func (s *fenced) pump(ctx context.Context, in <-chan *message.Message, out chan<- *message.Message) {
	for {
		var msg *message.Message
		select {
		case m, ok := <-in:
			if !ok {
				return
			}
			msg = m
		case <-s.closing:
			return
		case <-ctx.Done():
			return
		}
		d := s.f.decide(msg)
		switch d.act {
		case ack:
			msg.Ack()
			continue
		case retry:
			s.f.backoff(s.closing)
			msg.Nack()
			continue
		}
		msg.SetContext(context.WithValue(d.ctx, decidedKey{}, true))
		// Closing wins over a reader that is ready: nothing is handed out
		// once Close has begun.
		select {
		case <-s.closing:
			s.drop(msg, d)
			return
		default:
		}
		select {
		case out <- msg:
			s.watch(msg, d)
		case <-s.closing:
			s.drop(msg, d)
			return
		case <-ctx.Done():
			s.drop(msg, d)
			return
		}
	}
}

// drop gives back a message that was decided but not handed out.
func (s *fenced) drop(msg *message.Message, d decision) {
	msg.Nack()
	d.span.End()
}

// watch reports an admitted message's outcome when it is acked or nacked,
// and ends its span.
func (s *fenced) watch(msg *message.Message, d decision) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer d.span.End()
		select {
		case <-msg.Acked():
			s.f.handled(d, nil)
		case <-msg.Nacked():
			s.f.handled(d, errNacked)
		case <-s.closing:
		}
	}()
}

var errNacked = errors.New("wmsink: the handler nacked the message")

// Close closes the decorated subscriber and returns once every channel
// this one handed out is closed.
func (s *fenced) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.closing)
	s.mu.Unlock()
	err := s.sub.Close()
	s.wg.Wait()
	return err
}

// decidedKey marks, in a message's context, that a Fencer has decided its
// delivery.
type decidedKey struct{}

func decided(ctx context.Context) bool {
	v, _ := ctx.Value(decidedKey{}).(bool)
	return v
}
