package wmsink

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Middleware fences every message the handler receives. A stale message,
// or one with an epoch the lease bucket never issued, is acked and dropped
// (reported, counted and logged); bad metadata is an error.
func (f *Fencer) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		var out []*message.Message
		err := f.fenceCtx(msg.Context(), msg.Metadata, func(ctx context.Context) error {
			// The handler runs under the message's span.
			msg.SetContext(ctx)
			var herr error
			out, herr = h(msg)
			return herr
		})
		if dropped(err) {
			return nil, nil
		}
		return out, err
	}
}
