package coordinator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
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
// them). Every write acknowledged before it began is seen; writes made
// while it runs may or may not be. It stops at the first error fn returns.
//
// It reads through an ephemeral consumer of one replica, which the server
// places on any of the stream's peers, not only its leader: on a
// replicated stream it can serve a follower's copy, a write or two behind
// the leader's (a purge acknowledged a moment ago still shows the key).
// So the scan first asks the leader for the last message on filter; a
// consumer that does not deliver it (or a later one) read a copy behind
// the leader, and the scan is made again, a few times, as the follower
// catches up. A copy still behind then has what it lacks read from the
// leader, one message at a time; a marker that expired on the leader
// meanwhile leaves nothing there to read, so only on a copy behind by more
// than a marker's TTL can a key removed still show.
func scanLast(ctx context.Context, js jetstream.JetStream, stream, filter string, fn func(scanned) error) error {
	lr := leader.NewReader(js, stream)
	var last uint64
	err := askAgain(ctx, func() error {
		m, err := lr.Last(ctx, filter)
		if err == nil && m != nil {
			last = m.Seq
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("coordinator: read %s of stream %s: %w", filter, stream, err)
	}
	if last == 0 {
		return nil // the leader holds nothing on filter
	}
	found := map[string]scanned{}
	for attempt := 1; ; attempt++ {
		clear(found)
		var seen uint64 // the highest position the consumer delivered
		err := scanConsumer(ctx, js, stream, filter, func(s scanned) {
			found[s.subject] = s
			seen = max(seen, s.seq)
		})
		if err != nil {
			return err
		}
		if seen >= last {
			break
		}
		if attempt < scanAttempts {
			select {
			case <-ctx.Done():
				return fmt.Errorf("coordinator: read %s of stream %s: %w", filter, stream, ctx.Err())
			case <-timeAfter(backoff(attempt + 4)):
			}
			continue
		}
		if err := catchUp(ctx, lr, filter, seen, last, found); err != nil {
			return fmt.Errorf("coordinator: read %s of stream %s from its leader: %w", filter, stream, err)
		}
		break
	}
	ordered := make([]scanned, 0, len(found))
	for _, s := range found {
		ordered = append(ordered, s)
	}
	slices.SortFunc(ordered, func(a, b scanned) int { return cmp.Compare(a.seq, b.seq) })
	for _, s := range ordered {
		if err := fn(s); err != nil {
			return err
		}
	}
	return nil
}

// scanAttempts is how many times scanLast reads through a consumer before
// it reads what a lagging copy lacks from the leader: about a second.
const scanAttempts = 4

// catchUp reads the messages on filter after position seen, up to last,
// from the stream's leader into found, each replacing an older message of
// its subject.
func catchUp(ctx context.Context, r *leader.Reader, filter string, seen, last uint64, found map[string]scanned) error {
	for next := seen + 1; next <= last; {
		var m *leader.Msg
		err := askAgain(ctx, func() error {
			var err error
			m, err = r.Next(ctx, next, filter)
			return err
		})
		if err != nil {
			return err
		}
		if m == nil || m.Seq > last {
			return nil
		}
		next = m.Seq + 1
		if old, ok := found[m.Subject]; !ok || old.seq < m.Seq {
			found[m.Subject] = scanned{subject: m.Subject, seq: m.Seq, header: m.Header, data: m.Data, time: m.Time, marker: leader.IsMarker(m.Header)}
		}
	}
	return nil
}

// askAgain calls f until it returns other than nats.ErrNoResponders, at
// most 10 times in about five seconds: on a cluster the JetStream API, or
// a consumer just created, can have no responder for a moment while
// streams and consumers are placed nearby, for a second or more on a busy
// machine.
func askAgain(ctx context.Context, f func() error) error {
	err := f()
	for attempt := 1; attempt <= 10 && errors.Is(err, nats.ErrNoResponders); attempt++ {
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (after: %v)", ctx.Err(), err)
		case <-timeAfter(backoff(attempt + 2)):
		}
		err = f()
	}
	return err
}

// scanConsumer reads the last message of every subject on filter through
// an ephemeral consumer, calling fn with each.
func scanConsumer(ctx context.Context, js jetstream.JetStream, stream, filter string, fn func(scanned)) error {
	cfg := jetstream.ConsumerConfig{
		DeliverPolicy:     jetstream.DeliverLastPerSubjectPolicy,
		FilterSubject:     filter,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: time.Minute,
	}
	var cons jetstream.Consumer
	err := askAgain(ctx, func() error {
		var err error
		cons, err = js.CreateConsumer(ctx, stream, cfg)
		return err
	})
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
	empty, unanswered := 0, 0
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
			fn(s)
			done = md.NumPending == 0
		}
		err = batch.Error()
		if n == 0 && errors.Is(err, nats.ErrNoResponders) {
			// A consumer just created may not be heard on this server
			// yet: its pull requests meet no responder for a moment.
			if unanswered++; unanswered > 10 {
				return fmt.Errorf("coordinator: read %s of stream %s: its consumer %s answers no pull request: %w", filter, stream, cons.CachedInfo().Name, err)
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("coordinator: read %s of stream %s: %w (after: %v)", filter, stream, ctx.Err(), err)
			case <-timeAfter(backoff(unanswered + 2)):
			}
			continue
		}
		if err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
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
