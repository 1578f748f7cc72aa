package jspub

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
)

// BatchAck is the server's answer to a committed atomic batch.
type BatchAck struct {
	Stream string
	// Seq is the stream sequence of the batch's last message. The server
	// stores a batch's messages in order at consecutive sequences, so
	// message i of n is at Seq-(n-1-i).
	Seq uint64
	// Count is how many messages the server says the batch held.
	Count int
}

// Batch publishes msgs as one JetStream atomic batch (nats-server 2.12 or
// later, on a stream with AllowAtomicPublish): the server stores all of
// them or none, and checks every message's expected-sequence headers
// against the stream as it is before the batch plus the batch's earlier
// messages. It sets the batch headers on msgs and waits for the commit's
// answer until ctx ends. An error that is not a *jetstream.APIError leaves
// the outcome unknown: the batch may have been stored.
func Batch(ctx context.Context, nc *nats.Conn, msgs []*nats.Msg) (BatchAck, error) {
	if len(msgs) == 0 {
		return BatchAck{}, fmt.Errorf("atomic batch: no messages")
	}
	id := nuid.Next()
	for i, m := range msgs {
		if m.Header == nil {
			m.Header = nats.Header{}
		}
		m.Header["Nats-Batch-Id"] = []string{id}
		m.Header["Nats-Batch-Sequence"] = []string{strconv.Itoa(i + 1)}
		if i < len(msgs)-1 {
			if err := nc.PublishMsg(m); err != nil {
				return BatchAck{}, fmt.Errorf("atomic batch: publish message %d of %d: %w", i+1, len(msgs), err)
			}
		}
	}
	last := msgs[len(msgs)-1]
	last.Header["Nats-Batch-Commit"] = []string{"1"}
	resp, err := nc.RequestMsgWithContext(ctx, last)
	if err != nil {
		return BatchAck{}, fmt.Errorf("atomic batch: commit: %w", err)
	}
	var ack struct {
		Error  *jetstream.APIError `json:"error"`
		Stream string              `json:"stream"`
		Seq    uint64              `json:"seq"`
		Count  int                 `json:"count"`
	}
	if err := json.Unmarshal(resp.Data, &ack); err != nil {
		return BatchAck{}, fmt.Errorf("atomic batch: commit: decode the answer %q: %w", resp.Data, err)
	}
	if ack.Error != nil {
		return BatchAck{}, ack.Error
	}
	if ack.Count != len(msgs) || ack.Seq < uint64(len(msgs)) {
		return BatchAck{}, fmt.Errorf("atomic batch: commit: the answer names %d messages ending at sequence %d for a batch of %d", ack.Count, ack.Seq, len(msgs))
	}
	return BatchAck{Stream: ack.Stream, Seq: ack.Seq, Count: ack.Count}, nil
}
