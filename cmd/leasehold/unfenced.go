package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/history"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/worker"
)

// runUnfenced is `leasehold sink --unsafe-no-fence`: it reads the effect
// log in order and writes every effect into the KV bucket under its
// idempotency key — first writer wins, as a deduping sink does — without
// comparing epochs. Barriers are read and recorded but raise nothing. It
// records the same history a fenced runner does, so the chaos checker can
// show what the fence is for: a zombie's write that lands behind its
// successor's barrier is applied here.
func runUnfenced(ctx context.Context, js jetstream.JetStream, f sinkFlags, hist *history.Writer, log *slog.Logger) error {
	kv, err := js.KeyValue(ctx, f.kvBucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = retry.Value(ctx, func(ctx context.Context) (jetstream.KeyValue, error) {
			return js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: f.kvBucket, History: 1, Storage: jetstream.FileStorage})
		})
	}
	if err != nil {
		return fmt.Errorf("bucket %s: %w", f.kvBucket, err)
	}
	cons, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Consumer, error) {
		return js.CreateOrUpdateConsumer(ctx, worker.EffectsStream(f.conn.prefix), jetstream.ConsumerConfig{
			Durable:       f.conn.prefix + "-" + f.name + "-unfenced",
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       5 * time.Second,
			MaxDeliver:    -1,
			MaxAckPending: 100,
		})
	})
	if err != nil {
		return fmt.Errorf("consumer on %s: %w", worker.EffectsStream(f.conn.prefix), err)
	}
	subject := "$KV." + kv.Bucket() + "."
	failures := 0
	for ctx.Err() == nil {
		batch, err := cons.Fetch(100, jetstream.FetchMaxWait(500*time.Millisecond))
		if err == nil {
			for m := range batch.Messages() {
				if err = applyUnfenced(ctx, js, subject, m, hist); err != nil {
					break
				}
			}
		}
		if err == nil {
			failures = 0
			continue
		}
		if ctx.Err() != nil {
			break
		}
		failures++
		wait := min(2*time.Second, 10*time.Millisecond<<min(failures, 8))
		log.Warn("unfenced sink: retrying", "err", err, "wait", wait)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
	return nil
}

func applyUnfenced(ctx context.Context, js jetstream.JetStream, subject string, m jetstream.Msg, hist *history.Writer) error {
	md, err := m.Metadata()
	if err != nil {
		return err
	}
	pos := md.Sequence.Stream
	st, err := leasehold.StampFromHeader(m.Headers())
	if err != nil {
		hist.Record(history.Event{Kind: history.Decision, Outcome: "bad_stamp", Position: pos})
		return m.Term()
	}
	ev := history.Event{Kind: history.Decision, Partition: uint32(st.Partition), Epoch: uint64(st.Epoch), Key: st.Key, Position: pos}
	if _, barrier := m.Headers()[leasehold.HeaderBarrier]; barrier {
		ev.Outcome, ev.Max = "advanced", uint64(st.Epoch)
		hist.Record(ev)
		return m.Ack()
	}
	out := nats.NewMsg(subject + st.Key)
	st.SetHeader(out.Header)
	out.Data = m.Data()
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ev.Outcome = "accepted"
	if _, err := js.PublishMsg(pctx, out, jetstream.WithExpectLastSequencePerSubject(0)); err != nil {
		var apiErr *jetstream.APIError
		if !errors.As(err, &apiErr) || apiErr.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequence {
			return fmt.Errorf("apply %s: %w", st.Key, err)
		}
		ev.Outcome = "duplicate"
	}
	hist.Record(ev)
	applied := ev
	applied.Reason, applied.Position = applyStage, 0
	hist.Record(applied)
	return m.Ack()
}
