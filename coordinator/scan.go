package coordinator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/leader"
)

// scanned is the last message on one subject, as scanLast delivers it.
type scanned struct {
	subject string
	seq     uint64
	header  nats.Header
	data    []byte
	time    time.Time // the server's time of the write
	marker  bool      // a delete, purge or expiry marker
}

// scanBatch is how many messages one scan request asks for.
const scanBatch = 2048

// scanLast calls fn with the last message of every subject of stream
// matching filter, in stream order, headers included (kv.Watch hides
// them). It reads through an ephemeral consumer, which the stream leader
// serves. Writes made while it runs may or may not be seen. It stops at
// the first error fn returns.
func scanLast(ctx context.Context, js jetstream.JetStream, stream, filter string, fn func(scanned) error) error {
	cfg := jetstream.ConsumerConfig{
		DeliverPolicy:     jetstream.DeliverLastPerSubjectPolicy,
		FilterSubject:     filter,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: time.Minute,
	}
	cons, err := js.CreateConsumer(ctx, stream, cfg)
	// On a cluster, the JetStream API can have no responder for a moment
	// while streams are created or deleted nearby, for a second or more on
	// a busy machine: ask again, for about five seconds at most.
	for attempt := 1; attempt <= 10 && errors.Is(err, nats.ErrNoResponders); attempt++ {
		select {
		case <-ctx.Done():
			return fmt.Errorf("coordinator: read %s of stream %s: %w (after: %v)", filter, stream, ctx.Err(), err)
		case <-timeAfter(backoff(attempt + 2)):
		}
		cons, err = js.CreateConsumer(ctx, stream, cfg)
	}
	if err != nil {
		return fmt.Errorf("coordinator: read %s of stream %s: %w", filter, stream, err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = js.DeleteConsumer(dctx, stream, cons.CachedInfo().Name) // else it goes when inactive
	}()
	if cons.CachedInfo().NumPending == 0 {
		return nil
	}
	empty := 0
	for {
		batch, err := cons.FetchNoWait(scanBatch)
		if err != nil {
			return fmt.Errorf("coordinator: read %s of stream %s: %w", filter, stream, err)
		}
		n, done := 0, false
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				return fmt.Errorf("coordinator: read %s of stream %s: %w", filter, stream, err)
			}
			s := scanned{subject: m.Subject(), seq: md.Sequence.Stream, header: m.Headers(), data: m.Data(), time: md.Timestamp}
			s.marker = leader.IsMarker(s.header)
			if err := fn(s); err != nil {
				return err
			}
			done = md.NumPending == 0
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return fmt.Errorf("coordinator: read %s of stream %s: %w", filter, stream, err)
		}
		if done {
			return nil
		}
		if n > 0 {
			empty = 0
			continue
		}
		// Pending messages, yet none delivered: what was pending may have
		// gone since (a marker that expired, a key purged), or the
		// consumer is behind the stream for a moment. Ask it.
		info, err := cons.Info(ctx)
		if err != nil {
			return fmt.Errorf("coordinator: read %s of stream %s: %w", filter, stream, err)
		}
		if info.NumPending == 0 {
			return nil
		}
		if empty++; empty > 20 {
			return fmt.Errorf("coordinator: read %s of stream %s: the server delivered nothing of the %d messages it says are pending", filter, stream, info.NumPending)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("coordinator: read %s of stream %s: %w", filter, stream, ctx.Err())
		case <-timeAfter(backoff(empty)):
		}
	}
}
