package wmsink

import (
	"github.com/ThreeDotsLabs/watermill/message"
)

// Middleware fences every message the handler receives: the handler runs
// only for admitted effects, under the message's span; barriers, refused
// and badly stamped messages are acked without it (see the package
// documentation). A message whose decision fails is nacked after a
// backoff. Nothing is held while the handler runs, so handlers of any
// topics, sharing a Fencer, never wait on each other. A message already
// decided by the Fencer's Subscriber goes straight to the handler.
func (f *Fencer) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if decided(msg.Context()) {
			return h(msg)
		}
		d := f.decide(msg)
		switch d.act {
		case ack:
			return nil, nil
		case retry:
			f.backoff(msg.Context().Done())
			return nil, d.err
		}
		defer d.span.End()
		msg.SetContext(d.ctx)
		out, err := h(msg)
		f.handled(d, err)
		return out, err
	}
}
