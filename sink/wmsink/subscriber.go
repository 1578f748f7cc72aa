package wmsink

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/leasehold/leasehold"
)

// Subscriber returns a decorator that drops stale messages (and forged
// epochs) as they arrive from sub, acking them, and applies barriers, so
// that handlers never see them. It is a filter, not a fence: a message
// that passes can still turn stale before its handler writes. Fence the
// write itself with Middleware or a Sink.
func (f *Fencer) Subscriber() message.SubscriberDecorator {
	return func(sub message.Subscriber) (message.Subscriber, error) {
		return &filtered{Subscriber: sub, f: f}, nil
	}
}

type filtered struct {
	message.Subscriber
	f *Fencer
}

// Subscribe forwards sub's messages that the fence admits. Its goroutine
// ends when sub closes the upstream channel or ctx ends.
func (s *filtered) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for msg := range in {
			forward := false
			err := s.f.Fence(msg.Context(), msg.Metadata, func() error { forward = true; return nil })
			// Bad metadata goes on to the handler, whose Middleware (and a
			// poison queue) deal with it.
			forward = forward || errors.Is(err, leasehold.ErrBadStamp)
			switch {
			case forward:
				select {
				case out <- msg:
					continue
				case <-ctx.Done():
					msg.Nack()
					return
				}
			case err == nil || dropped(err):
				msg.Ack() // a barrier, or refused for good
			default:
				msg.Nack() // the fence store failed: try again
			}
		}
	}()
	return out, nil
}
