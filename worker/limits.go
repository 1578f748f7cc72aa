package worker

import (
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
)

// ErrEffectTooLarge is matched by the error of an effect that no sink could
// store: with its headers and the room a sink needs for its own
// (leasehold.SinkHeaderRoom), it exceeds the server's max payload. The
// attempt fails as permanent: the job is dead-lettered, not retried for
// ever, and no sink is left with an effect it can never apply.
var ErrEffectTooLarge = errors.New("worker: effect too large for a sink to store")

// checkSize refuses msg when a sink could not store it after adding its
// own headers, with room bytes more headers of the worker's: the server's
// max payload counts headers and data alike.
func (r *runner) checkSize(msg *nats.Msg, room int) error {
	limit := r.w.cfg.JetStream.Conn().MaxPayload()
	if limit <= 0 {
		return nil // not connected yet: the server refuses what is too large
	}
	size := int64(len(msg.Data) + headerSize(msg.Header) + room)
	if size+leasehold.SinkHeaderRoom > limit {
		return Permanent(fmt.Errorf("%w: %d bytes of data and headers, and sinks need %d bytes of room for their own headers under the server's max payload of %d: store large values elsewhere and emit a reference",
			ErrEffectTooLarge, size, leasehold.SinkHeaderRoom, limit))
	}
	return nil
}

// headerFrame is what a message's headers take on the wire beside their
// lines: "NATS/1.0\r\n" before them and "\r\n" after.
const headerFrame = len("NATS/1.0\r\n") + len("\r\n")

// headerSize is the size of h on the wire: "NATS/1.0\r\n", one
// "Name: value\r\n" line per value, and the closing "\r\n".
func headerSize(h nats.Header) int {
	if len(h) == 0 {
		return 0
	}
	n := headerFrame
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + 2 + len(v) + 2
		}
	}
	return n
}

// finalRoom is what marking an effect of the job at seq as its attempt's
// final adds to the headers the plain mark wrote, at the most, in the form
// the worker writes: the count of effects (up to leasehold.MaxJobEffects)
// and the job before it (below seq, or with several jobs in flight any
// job, and then the floor, below seq). An effect is sized as the final it
// may become without writing the final's headers only to take them off
// again.
func (r *runner) finalRoom(seq uint64) int {
	if r.w.cfg.StampFormat == leasehold.StampLegacy {
		return finalRoom(seq, r.policy.floored())
	}
	return compactFinalRoom(seq, r.policy.floored())
}

// compactFinalRoom is finalRoom in the compact form: the final's fields
// follow the plain mark's in its one HeaderMark value, each after a
// space.
func compactFinalRoom(seq uint64, floored bool) int {
	room := len(" ") + decimalLen(leasehold.MaxJobEffects) + len(" ")
	if !floored {
		return room + decimalLen(seq-1)
	}
	return room + decimalLen(1<<63) + len(" ") + decimalLen(seq-1)
}

// finalRoom is what the final adds in the legacy form: a header per
// field.
func finalRoom(seq uint64, floored bool) int {
	const line = len(": \r\n")
	room := len(leasehold.HeaderEffects) + line + decimalLen(leasehold.MaxJobEffects) + len(leasehold.HeaderAfter) + line
	if !floored {
		return room + decimalLen(seq-1)
	}
	return room + decimalLen(1<<63) + len(leasehold.HeaderFloor) + line + decimalLen(seq-1)
}

// decimalLen is the number of decimal digits of n.
func decimalLen(n uint64) int {
	d := 1
	for ; n >= 10; n /= 10 {
		d++
	}
	return d
}
