package wmsink

import (
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
)

// HeaderBadStamp names, on a message moved to Config.Poison, what is wrong
// with its stamp.
const HeaderBadStamp = "Leasehold-Bad-Stamp"

// poison moves a copy of msg, whose stamp is bad for reason, to the poison
// topic, when one is configured.
func (f *Fencer) poison(msg *message.Message, reason error) error {
	if f.cfg.Poison == nil {
		return nil
	}
	cp := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		if keepHeader(k) {
			cp.Metadata[k] = v
		}
	}
	cp.Metadata[HeaderBadStamp] = reason.Error()
	if err := f.cfg.Poison.Publish(f.cfg.PoisonTopic, cp); err != nil {
		return fmt.Errorf("wmsink: move message %s with a bad stamp to %s: %w", msg.UUID, f.cfg.PoisonTopic, err)
	}
	return nil
}

// keepHeader reports whether a header travels with a message the Fencer
// republishes: leasehold's own and W3C trace context, nothing else. A
// header in the server's Nats- namespace changes how the server takes the
// write (Nats-Expected-Stream fails it, a Nats-Msg-Id drops a later
// message as its duplicate, Nats-Rollup purges a subject), and the rest is
// the publisher's business.
func keepHeader(name string) bool {
	const lh = "Leasehold-"
	if len(name) > len(lh) && strings.EqualFold(name[:len(lh)], lh) {
		for i := len(lh); i < len(name); i++ {
			if c := name[i]; c <= ' ' || c >= 0x7f || c == ':' {
				return false
			}
		}
		return true
	}
	return strings.EqualFold(name, "traceparent") || strings.EqualFold(name, "tracestate") || strings.EqualFold(name, "baggage")
}
