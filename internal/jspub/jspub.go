// Package jspub publishes a message to JetStream and waits for its
// acknowledgement, and stops waiting as soon as the connection drops.
//
// A synchronous JetStream publish is a request. When the server goes away
// after the message was written to it (a restart, a node lost), the answer
// never comes, and the publish waits out its whole timeout although the
// client knew at once that the answer was lost. An asynchronous publish's
// future fails with nats.ErrDisconnected when the connection starts to
// reconnect (nats.go clears its pending acknowledgements then), so waiting
// on the future ends the wait with the connection. A message published
// while the connection is down waits in the client's reconnect buffer and
// is acknowledged once it is back.
//
// Either way the message may have been stored: the caller treats the error
// as it treats a timeout (publish again under the same Nats-Msg-Id, or let
// a later step supersede it).
package jspub

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Publish publishes msg and waits for its acknowledgement until ctx ends.
// The error is the future's (nats.ErrDisconnected when the connection
// dropped, the server's API error, no responders), the publish's, or,
// when ctx ends first, ctx's cause wrapped in nats.ErrTimeout.
func Publish(ctx context.Context, js jetstream.JetStream, msg *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	fut, err := js.PublishMsgAsync(msg, opts...)
	if err != nil {
		return nil, err
	}
	select {
	case ack := <-fut.Ok():
		return ack, nil
	case err := <-fut.Err():
		return nil, err
	case <-ctx.Done():
		// The future stays with the client until its ack comes, the
		// connection drops, or the JetStream context's async timeout.
		return nil, fmt.Errorf("%w: %w", nats.ErrTimeout, context.Cause(ctx))
	}
}

// PublishRetry is Publish, sent again whenever a try goes unanswered for
// try or no stream answers, until one is acknowledged, the server refuses
// the message, the connection drops, or ctx ends. It returns the
// acknowledgement, how many times the message was sent, and the last
// try's error. A dropped connection ends it as it ends Publish: what to
// do then (send again once it is back, or let a later step supersede the
// message) is the caller's choice.
//
// In a cluster, a request that reached a stream leader as it stepped
// down is lost on a connection that stays up: Publish then waits for
// its whole deadline, where a new leader is usually elected within a
// second or two. msg must carry a Nats-Msg-Id, so that a copy the lost
// leader stored is taken for a duplicate of the one sent again (the
// acknowledgement then says Duplicate).
func PublishRetry(ctx context.Context, js jetstream.JetStream, msg *nats.Msg, try time.Duration, opts ...jetstream.PublishOpt) (*jetstream.PubAck, int, error) {
	if try <= 0 {
		return nil, 0, fmt.Errorf("jspub: a try of %v", try)
	}
	wait := 50 * time.Millisecond
	for tries := 1; ; tries++ {
		tctx, cancel := context.WithTimeout(ctx, try)
		ack, err := Publish(tctx, js, msg, opts...)
		cancel()
		if err == nil || ctx.Err() != nil {
			return ack, tries, err
		}
		noStream := errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse)
		if !noStream && !errors.Is(err, context.DeadlineExceeded) {
			// Refused by the server, or the connection dropped or
			// closed: not this function's to retry.
			return ack, tries, err
		}
		if noStream {
			// Nothing listens (a stream between leaders): the answer
			// came at once, so wait before asking again.
			select {
			case <-ctx.Done():
				return nil, tries, err
			case <-time.After(wait):
			}
			wait = min(2*wait, time.Second)
		}
	}
}

// APIPrefix is the JetStream API prefix js sends its requests under, with
// its trailing dot: what a request sent by hand (a pull request on a
// subscription of one's own) is published under.
func APIPrefix(js jetstream.JetStream) string {
	o := js.Options()
	switch {
	case o.APIPrefix != "":
		return strings.TrimSuffix(o.APIPrefix, ".") + "."
	case o.Domain != "":
		return "$JS." + o.Domain + ".API."
	}
	return jetstream.DefaultAPIPrefix
}
