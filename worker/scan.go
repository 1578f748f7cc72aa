package worker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/leader"
)

// scan reads the headers of the messages on filter from where cc starts,
// calling fn until it returns false or no message is left, at most
// maxScan of them. Every message stored before it began is read.
//
// It reads through an ephemeral consumer of one replica, which the server
// places on any of the stream's peers: on a replicated stream it can read
// a follower's copy behind the leader, which lacks a dead letter stored a
// moment ago, and a job dead-lettered would be reported done. So scan
// first asks the leader for the last message on filter, and a consumer
// that does not reach it reads a copy behind: the scan is made again as
// the follower catches up (fn may see a message more than once), and
// fails, saying so, if it stays behind for about two seconds.
func scan(ctx context.Context, js jetstream.JetStream, stream, filter string, cc jetstream.ConsumerConfig, fn func(jetstream.Msg, *jetstream.MsgMetadata) bool) error {
	cc.HeadersOnly = true
	return scanFull(ctx, js, stream, filter, cc, fn)
}

// scanFull is scan, reading the messages' data too unless cc says
// HeadersOnly.
func scanFull(ctx context.Context, js jetstream.JetStream, stream, filter string, cc jetstream.ConsumerConfig, fn func(jetstream.Msg, *jetstream.MsgMetadata) bool) error {
	last, err := leader.NewReader(js, stream).Last(ctx, filter)
	if err != nil {
		return err
	}
	if last == nil || (cc.OptStartTime != nil && last.Time.Before(*cc.OptStartTime)) {
		return nil // nothing on filter where the scan starts
	}
	for attempt := 1; ; attempt++ {
		seen, stopped, err := scanCopy(ctx, js, stream, filter, cc, fn)
		if err != nil || stopped || seen >= last.Seq {
			return err
		}
		if attempt == 5 {
			return fmt.Errorf("the replica of stream %s read for %s stayed behind its leader: it held up to %d, the leader %d", stream, filter, seen, last.Seq)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Duration(attempt) * 200 * time.Millisecond):
		}
	}
}

// scanCopy is one scan through one consumer. It returns the highest
// position it read and whether fn stopped it.
func scanCopy(ctx context.Context, js jetstream.JetStream, stream, filter string, cc jetstream.ConsumerConfig, fn func(jetstream.Msg, *jetstream.MsgMetadata) bool) (seen uint64, stopped bool, err error) {
	cc.FilterSubject = filter
	cc.AckPolicy = jetstream.AckNonePolicy
	cc.MemoryStorage = true
	cc.Replicas = 1
	cc.InactiveThreshold = time.Minute
	cons, err := js.CreateConsumer(ctx, stream, cc)
	if err != nil {
		return 0, false, err
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = js.DeleteConsumer(dctx, stream, cons.CachedInfo().Name) // else it goes when inactive
	}()
	if cons.CachedInfo().NumPending == 0 {
		return 0, false, nil
	}
	unanswered := 0
	for n := 0; n < maxScan; {
		// The fetch's goroutine ends with its context, which ends when
		// this batch is read: a scan that stops early leaves none
		// waiting for its request to expire.
		fctx, cancel := context.WithTimeout(ctx, time.Second)
		batch, err := cons.Fetch(256, jetstream.FetchContext(fctx))
		if err != nil {
			cancel()
			return seen, false, err
		}
		got := 0
		var stop, stopped bool
		for m := range batch.Messages() {
			got++
			n++
			md, merr := m.Metadata()
			if merr != nil {
				cancel()
				return seen, false, merr
			}
			seen = max(seen, md.Sequence.Stream)
			if !fn(m, md) {
				stop, stopped = true, true
				break
			}
			if md.NumPending == 0 {
				stop = true
				break
			}
		}
		err = batch.Error()
		cancel()
		if stop {
			return seen, stopped, nil
		}
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			err = jetstream.ErrNoMessages // the request expired
		}
		if got == 0 && errors.Is(err, nats.ErrNoResponders) {
			// On a cluster, a consumer just created may not be heard on
			// this server yet: its pull requests meet no responder for a
			// moment. Ask again, for a few seconds at most.
			if unanswered++; unanswered > 10 {
				return seen, false, fmt.Errorf("its consumer answers no pull request: %w", err)
			}
			select {
			case <-ctx.Done():
				return seen, false, ctx.Err()
			case <-time.After(time.Duration(unanswered) * 100 * time.Millisecond):
			}
			continue
		}
		if err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return seen, false, err
		}
		if got == 0 {
			// What was pending went meanwhile (trimmed, aged out).
			info, err := cons.Info(ctx)
			if err != nil {
				return seen, false, err
			}
			if info.NumPending == 0 {
				return seen, false, nil
			}
		}
		if ctx.Err() != nil {
			return seen, false, ctx.Err()
		}
	}
	return seen, false, fmt.Errorf("gave up after reading %d messages of %s", maxScan, filter)
}
