package worker

import (
	"bytes"
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
)

// ErrPreempted is matched by the error of an effect whose publish the
// stream answered as a duplicate of a message that is not this effect:
// something else was stored under its Nats-Msg-Id first. The attempt fails
// and counts towards MaxAttempts; the job is never committed on the word
// of a duplicate acknowledgement alone.
var ErrPreempted = errors.New("worker: the stream holds another message under this effect's message ID")

// confirm accepts an acknowledgement, reading the stored message back when
// the stream answered "duplicate": such an answer says that some message
// with the effect's Nats-Msg-Id is stored, not that it is this one, and
// anyone who can publish on the subject could have stored it.
func (r *runner) confirm(ctx context.Context, msg *nats.Msg, ack *jetstream.PubAck) error {
	if ack == nil || !ack.Duplicate {
		return nil
	}
	rctx, cancel := context.WithTimeout(ctx, r.w.cfg.EffectTimeout)
	defer cancel()
	stored, err := leader.NewReader(r.w.cfg.JetStream, ack.Stream).Next(rctx, ack.Sequence, "")
	if err != nil {
		// Unknown: the publish is treated as failed and its job run again.
		return &EffectError{Subject: msg.Subject, Key: msg.Header.Get(leasehold.HeaderKey), Err: fmt.Errorf("confirm a duplicate acknowledgement: %w", err)}
	}
	if stored != nil && stored.Seq == ack.Sequence && sameMessage(msg, stored) {
		return nil
	}
	r.w.tel.Metrics.EffectsPreempted.Add(ctx, 1)
	r.log.Error("an effect was answered as a duplicate of a message that is not it: something else published under its message ID; failing the attempt",
		"subject", msg.Subject, "msg_id", msg.Header.Get(jetstream.MsgIDHeader), "stream", ack.Stream, "seq", ack.Sequence)
	return &EffectError{Subject: msg.Subject, Key: msg.Header.Get(leasehold.HeaderKey),
		Err: fmt.Errorf("%w (stream %s position %d)", ErrPreempted, ack.Stream, ack.Sequence)}
}

// sameMessage reports whether stored is msg: same subject, stamp, message
// ID and data.
func sameMessage(msg *nats.Msg, stored *leader.Msg) bool {
	if stored.Subject != msg.Subject || !bytes.Equal(stored.Data, msg.Data) {
		return false
	}
	for _, h := range []string{jetstream.MsgIDHeader, leasehold.HeaderStamp, leasehold.HeaderScope, leasehold.HeaderPartition, leasehold.HeaderEpoch, leasehold.HeaderAcquisition, leasehold.HeaderKey} {
		if stored.Header.Get(h) != msg.Header.Get(h) {
			return false
		}
	}
	return true
}
