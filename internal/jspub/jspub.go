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
	"fmt"
	"strings"

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
