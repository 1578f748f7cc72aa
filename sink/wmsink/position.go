package wmsink

import (
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Position is a message's place in its log: a JetStream stream and the
// message's sequence in it.
type Position struct {
	Stream string
	Seq    uint64
}

// positionKey is the metadata key under which the Fencer's Unmarshaler
// hands a message's position to the Fencer, which takes it out before
// the handler sees the message. Its value starts with the Fencer's token,
// so that metadata that arrived from the network under this name (it is
// stripped, but a subscriber built without the Unmarshaler would pass it
// on) is never taken for a position.
const positionKey = "_leasehold_position"

// watermillUUIDHeader is the header watermill-nats carries a message's
// UUID in.
const watermillUUIDHeader = "_watermill_message_uuid"

func newToken() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// JetStreamUnmarshaler turns a JetStream message into a Watermill
// message: the method set of watermill-nats' pkg/jetstream Unmarshaler.
type JetStreamUnmarshaler interface {
	Unmarshal(jetstream.Msg) (*message.Message, error)
}

// Unmarshaler returns the Unmarshaler to build a watermill-nats JetStream
// subscriber with (SubscriberConfig.Unmarshaler), so that its messages
// carry their log positions to this Fencer. It unmarshals with inner, or,
// when inner is nil, as watermill-nats does by default: the UUID from
// _watermill_message_uuid, and every other header but the server's
// Nats-Msg-Id and Nats-Expected-* as metadata.
func (f *Fencer) Unmarshaler(inner JetStreamUnmarshaler) JetStreamUnmarshaler {
	return &unmarshaler{token: f.token, inner: inner}
}

type unmarshaler struct {
	token string
	inner JetStreamUnmarshaler
}

func (u *unmarshaler) Unmarshal(m jetstream.Msg) (*message.Message, error) {
	var wm *message.Message
	if u.inner != nil {
		var err error
		if wm, err = u.inner.Unmarshal(m); err != nil {
			return nil, err
		}
	} else {
		wm = unmarshalDefault(m.Headers(), m.Data())
	}
	var pos Position
	if meta, err := m.Metadata(); err == nil {
		pos = Position{Stream: meta.Stream, Seq: meta.Sequence.Stream}
	}
	return u.mark(wm, pos), nil
}

// mark writes pos into wm's metadata for the Fencer, and removes any
// position that came with the message.
func (u *unmarshaler) mark(wm *message.Message, pos Position) *message.Message {
	if wm.Metadata == nil {
		wm.Metadata = message.Metadata{}
	}
	dropPositionKeys(wm.Metadata)
	if pos.Stream != "" && pos.Seq > 0 {
		wm.Metadata[positionKey] = u.token + " " + pos.Stream + " " + strconv.FormatUint(pos.Seq, 10)
	}
	return wm
}

// NATSMsgUnmarshaler turns a NATS message into a Watermill message: the
// method set of watermill-nats' pkg/nats Unmarshaler.
type NATSMsgUnmarshaler interface {
	Unmarshal(*nats.Msg) (*message.Message, error)
}

// NATSUnmarshaler returns the Unmarshaler to build a watermill-nats
// pkg/nats subscriber with (SubscriberConfig.Unmarshaler), JetStream on,
// so that its messages carry their log positions to this Fencer. It
// unmarshals with inner, or, when inner is nil, as pkg/nats' NATSMarshaler
// does. A message that did not come through JetStream (the subscriber's
// JetStream is disabled) has no position: the Fencer nacks it with
// ErrNoPosition unless Config.UnsafeArrivalOrder is set.
func (f *Fencer) NATSUnmarshaler(inner NATSMsgUnmarshaler) NATSMsgUnmarshaler {
	return &natsUnmarshaler{u: unmarshaler{token: f.token}, inner: inner}
}

type natsUnmarshaler struct {
	u     unmarshaler
	inner NATSMsgUnmarshaler
}

func (n *natsUnmarshaler) Unmarshal(m *nats.Msg) (*message.Message, error) {
	var wm *message.Message
	if n.inner != nil {
		var err error
		if wm, err = n.inner.Unmarshal(m); err != nil {
			return nil, err
		}
	} else {
		wm = unmarshalDefault(m.Header, m.Data)
	}
	var pos Position
	if meta, err := m.Metadata(); err == nil {
		pos = Position{Stream: meta.Stream, Seq: meta.Sequence.Stream}
	}
	return n.u.mark(wm, pos), nil
}

// unmarshalDefault is watermill-nats' default unmarshaling, except that a
// header given more than once with different values is left out (a
// stamp header so given then reads as missing: a bad stamp) instead of
// failing the message, which watermill-nats' subscriber cannot handle.
func unmarshalDefault(hdr nats.Header, data []byte) *message.Message {
	wm := message.NewMessage(hdr.Get(watermillUUIDHeader), data)
	for k, vs := range hdr {
		switch k {
		case watermillUUIDHeader, nats.MsgIdHdr, nats.ExpectedLastMsgIdHdr, nats.ExpectedStreamHdr, nats.ExpectedLastSubjSeqHdr, nats.ExpectedLastSeqHdr:
			continue
		}
		if len(vs) == 0 {
			continue
		}
		same := true
		for _, v := range vs[1:] {
			same = same && v == vs[0]
		}
		if same {
			wm.Metadata.Set(k, vs[0])
		}
	}
	return wm
}

// dropPositionKeys removes every spelling of positionKey from md.
func dropPositionKeys(md message.Metadata) {
	for k := range md {
		if strings.EqualFold(k, positionKey) {
			delete(md, k)
		}
	}
}

// takePosition removes the position from md and returns it, when this
// Fencer's Unmarshaler wrote it.
func (f *Fencer) takePosition(md message.Metadata) (Position, bool) {
	v, ok := md[positionKey]
	dropPositionKeys(md)
	if !ok {
		return Position{}, false
	}
	token, rest, ok := strings.Cut(v, " ")
	if !ok || token != f.token {
		return Position{}, false
	}
	stream, seq, ok := strings.Cut(rest, " ")
	n, err := strconv.ParseUint(seq, 10, 64)
	if !ok || err != nil || stream == "" || n == 0 {
		return Position{}, false
	}
	return Position{Stream: stream, Seq: n}, true
}
