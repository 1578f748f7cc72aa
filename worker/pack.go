package worker

import (
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// With Config.PackEffects, an attempt holds every effect it emits on a
// subject, not only the latest, and they leave together: the attempt's
// final on the subject is one message packing them all
// (leasehold.HeaderPack), or the plain final when the attempt emitted one
// effect there. A stream sink reads it as the effects it packs, at one log
// position, so that a job of three effects costs it one message to fetch,
// decide and acknowledge, not three.
//
// A packed message carries the stamp, message ID, origin and job mark its
// last effect would carry alone; its body holds each effect's key, own
// headers (trace context and the caller's, never the worker's or the
// server's) and data, in the order they were held. When the held effects
// of a subject and the next would not fit in one message (the server's
// max payload, less the room of the pack's headers, of its final's and
// of a sink's, as checkSize reasons), or would be more than
// leasehold.MaxPackEffects, the held ones leave at once, packed under the
// plain mark (or as the plain effect, if one), and holding starts again
// from the next: the final counts them all. A failing attempt sends
// nothing of what it held, and an abort marker only where something left.

// packRoom is the room of HeaderPack's line: "Leasehold-Pack: 1 4096\r\n".
var packRoom = len(leasehold.HeaderPack) + len(": 1 \r\n") + decimalLen(leasehold.MaxPackEffects)

// packFits reports whether the effects o holds and e, the next, fit in one
// packed message: at most leasehold.MaxPackEffects, and with e's headers
// (its message's, which the pack's are at most, but for HeaderPack's
// line), the room of the final's (room) and a sink's, within the server's
// max payload. o.bytes is what the held effects add to the body.
func (r *runner) packFits(o *subjectOutput, e heldEffect, room int) bool {
	if len(o.packed)+2 > leasehold.MaxPackEffects {
		return false
	}
	limit := r.w.cfg.JetStream.Conn().MaxPayload()
	if limit <= 0 {
		return true // not connected yet: checkSize let the effect by too
	}
	size := int64(o.bytes + e.size + headerSize(e.msg.Header) + unwrittenSize(e.msg.Header, e.unwritten) + packRoom + room)
	return size+leasehold.SinkHeaderRoom <= limit
}

// pack makes one message of effects rest and last, in that order: last's
// message, its subject, stamp, message ID and origin, with HeaderPack and
// a body of them all (see leasehold.AppendPacked), and without a job mark,
// which the caller writes. The held effects' headers are emptied of what
// is the worker's to write on the message: they are not sent alone.
func (j *Job) pack(rest []heldEffect, last heldEffect) *nats.Msg {
	size := last.size
	for _, e := range rest {
		size += e.size
	}
	replayed := j.replayed()
	body := make([]byte, 0, size)
	for _, e := range rest {
		body = appendHeld(body, e, replayed)
	}
	h := last.msg.Header
	stamp, id, origin := h[leasehold.HeaderStamp], h[jetstream.MsgIDHeader], h[leasehold.HeaderOrigin]
	body = appendHeld(body, last, replayed)
	clear(h)
	h[leasehold.HeaderStamp], h[jetstream.MsgIDHeader] = stamp, id
	if replayed {
		h[leasehold.HeaderOrigin] = origin
	}
	leasehold.SetPackHeader(h, len(rest)+1)
	last.msg.Data = body
	return last.msg
}

// appendHeld appends e to a packed body, with its own headers only: the
// stamp, job mark and message ID are the packed message's, and so is the
// origin of a replayed job (replayed).
func appendHeld(body []byte, e heldEffect, replayed bool) []byte {
	h := e.msg.Header
	for k := range h {
		if !ownHeader(k) || replayed && k == leasehold.HeaderOrigin {
			delete(h, k)
		}
	}
	return leasehold.AppendPacked(body, leasehold.PackedEffect{Key: e.key, Header: h, Data: e.msg.Data})
}

// ownHeader reports whether an effect's header named name is the
// effect's own, which a packed message carries in its body: not a header
// of the stamp or the job mark, not HeaderPack nor HeaderBarrier, and not
// in the server's Nats- namespace (a caller's Nats-Expected-Stream on an
// effect alone is the server's to read; packed, it could only make the
// message malformed), in any spelling.
func ownHeader(name string) bool {
	const natsPrefix = "Nats-"
	switch {
	case leasehold.IsStampHeader(name),
		isPackName(name),
		len(name) == len(leasehold.HeaderBarrier) && strings.EqualFold(name, leasehold.HeaderBarrier),
		len(name) >= len(natsPrefix) && strings.EqualFold(name[:len(natsPrefix)], natsPrefix):
		return false
	}
	return true
}

// isPackName reports whether name is leasehold.HeaderPack, in any
// spelling.
func isPackName(name string) bool {
	return len(name) == len(leasehold.HeaderPack) && strings.EqualFold(name, leasehold.HeaderPack)
}

// maxOwnHeader bounds an effect's own headers in a packed body, counted
// as "name: value\r\n" lines: what a stream takes in a message's headers
// (64 KiB, JetStream error 10097), less room for the stamp, job mark and
// origin the effect takes from the message when a sink reads it, and for a
// sink's own headers. No stream could store such an effect alone: a stream
// sink would send it to the dead-letter stream without its headers, where
// the worker can refuse it at once and say why.
const maxOwnHeader = 1<<16 - 1 - 4*leasehold.SinkHeaderRoom

// packableHeader refuses an effect whose headers a packed body could not
// carry: a name that is not a header field name (an RFC 9110 token), or
// own headers past maxOwnHeader, which a sink could republish nowhere.
// The server checks neither in a body.
func packableHeader(h nats.Header) error {
	size := 0
	for k, vs := range h {
		if k == "" {
			return errors.New("a header has an empty name: a packed message (Config.PackEffects) carries header field names only")
		}
		for i := 0; i < len(k); i++ {
			if !isTokenByte(k[i]) {
				return fmt.Errorf("header name %q holds the byte %#x: a packed message (Config.PackEffects) carries header field names (RFC 9110 tokens) only", k, k[i])
			}
		}
		if ownHeader(k) {
			for _, v := range vs {
				size += len(k) + len(": \r\n") + len(v)
			}
		}
	}
	if size > maxOwnHeader {
		return fmt.Errorf("%w: %d bytes of headers, and a packed effect's own may take %d (a stream takes 64 KiB of headers in a message, with room for the stamp and a sink's): send large values as data", ErrEffectTooLarge, size, maxOwnHeader)
	}
	return nil
}

func isTokenByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// replayed reports whether j is a job stored again (a replay or a move),
// whose effects carry its origin.
func (j *Job) replayed() bool {
	return j.Origin() != leasehold.OriginOf(j.r.info.Scope, j.Partition, j.Seq)
}
