package wmsink

import (
	"github.com/ThreeDotsLabs/watermill/message"
)

// Middleware fences every message the handler receives. A stale message,
// or one with an epoch the lease bucket never issued, is acked and dropped
// (reported, counted and logged); bad metadata is an error.
func (f *Fencer) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		var out []*message.Message
		err := f.Fence(msg.Context(), msg.Metadata, func() error {
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
