package chaos

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// readStream reads every message of stream on filter (or the last one per
// subject, with lastPerSubject) with an ordered consumer, and calls f for
// each with its stream sequence.
func readStream(ctx context.Context, js jetstream.JetStream, stream, filter string, lastPerSubject, headersOnly bool, f func(seq uint64, subject string, h nats.Header, data []byte) error) error {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return fmt.Errorf("chaos: read stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return fmt.Errorf("chaos: read stream %s: %w", stream, err)
	}
	if info.State.Msgs == 0 {
		return nil
	}
	cfg := jetstream.OrderedConsumerConfig{HeadersOnly: headersOnly}
	if filter != "" {
		cfg.FilterSubjects = []string{filter}
	}
	if lastPerSubject {
		cfg.DeliverPolicy = jetstream.DeliverLastPerSubjectPolicy
	}
	cons, err := s.OrderedConsumer(ctx, cfg)
	if err != nil {
		return fmt.Errorf("chaos: read stream %s: %w", stream, err)
	}
	// A fetch ends when its batch is full or its wait runs out: ask for no
	// more than the stream holds (the subjects, for the last of each), and
	// then for what the last message said is pending, so that no read
	// waits out the two seconds for messages that will not come. A count
	// too high only costs that wait; the loop ends on a message with
	// nothing pending after it.
	//
	// A fetch that brings nothing ends it too, but only where nothing was
	// to come: a filter may match no message. Before the last message it
	// is an error, for the caller to read again: the ordered consumer makes
	// its consumer again on every fetch, which on a cluster can leave a
	// fetch empty, and a log cut short there reads, to the checker, as
	// writes that never happened.
	want := info.State.Msgs
	if lastPerSubject {
		want = uint64(max(info.State.NumSubjects, 1))
	}
	whole := filter == "" && !lastPerSubject
	var read, pending uint64 // the last message read, and what it said followed it
	for {
		batch, err := cons.Fetch(int(min(want, 500)), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return fmt.Errorf("chaos: read stream %s: %w", stream, err)
		}
		n := 0
		last := false
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				return fmt.Errorf("chaos: read stream %s: %w", stream, err)
			}
			if err := f(md.Sequence.Stream, m.Subject(), m.Headers(), m.Data()); err != nil {
				return err
			}
			read, pending = md.Sequence.Stream, md.NumPending
			last = md.NumPending == 0
			want = max(md.NumPending, 1)
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, jetstream.ErrNoMessages) {
			return fmt.Errorf("chaos: read stream %s: %w", stream, err)
		}
		if last {
			return nil
		}
		if n == 0 {
			if read == 0 && whole || pending > 0 {
				return fmt.Errorf("chaos: read stream %s: a fetch brought nothing after sequence %d, with %d messages to follow (the stream held %d, up to sequence %d)", stream, read, pending, info.State.Msgs, info.State.LastSeq)
			}
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// readEffectLog reads the effect log in order.
func readEffectLog(ctx context.Context, js jetstream.JetStream, prefix string) ([]LogEntry, error) {
	var out []LogEntry
	err := readStream(ctx, js, worker.EffectsStream(prefix), "", false, true, func(seq uint64, subject string, h nats.Header, _ []byte) error {
		e := LogEntry{Position: seq, Subject: subject}
		st, err := leasehold.StampFromHeader(h)
		if err != nil {
			e.BadStamp = true
		} else {
			e.Stamp = st
			_, e.Barrier = headerValue(h, leasehold.HeaderBarrier)
			e.Mark, err = leasehold.JobMarkFromHeader(h)
			e.BadMark = err != nil
		}
		out = append(out, e)
		return nil
	})
	return out, err
}

// readJobs reads the job stream.
func readJobs(ctx context.Context, js jetstream.JetStream, prefix string) ([]Job, error) {
	var out []Job
	err := readStream(ctx, js, worker.JobsStream(prefix), "", false, true, func(seq uint64, subject string, h nats.Header, _ []byte) error {
		p, err := leasehold.ParsePartition(subject[strings.LastIndexByte(subject, '.')+1:])
		if err != nil {
			return fmt.Errorf("chaos: job %d on subject %s: %w", seq, subject, err)
		}
		out = append(out, Job{Partition: p, Seq: seq, ID: h.Get(jetstream.MsgIDHeader)})
		return nil
	})
	return out, err
}

// readDeadLetters reads the dead-letter stream.
func readDeadLetters(ctx context.Context, js jetstream.JetStream, prefix string) ([]Job, error) {
	var out []Job
	err := readStream(ctx, js, worker.DLQStream(prefix), "", false, true, func(seq uint64, subject string, h nats.Header, _ []byte) error {
		if worker.IsRecordSubject(prefix, subject) {
			return nil // what dlq replay or purge did, or a removed range: no dead letter
		}
		p, perr := leasehold.ParsePartition(subject[strings.LastIndexByte(subject, '.')+1:])
		s, serr := strconv.ParseUint(h.Get(worker.HeaderSeq), 10, 64)
		if perr != nil || serr != nil {
			return fmt.Errorf("chaos: dead letter %d on %s has no job sequence", seq, subject)
		}
		out = append(out, Job{Partition: p, Seq: s, ID: h.Get(worker.HeaderJobID)})
		return nil
	})
	return out, err
}

// readFinal reads the sink's KV bucket: each effect key with the stamp its
// value carries, and the keys whose value is a forged payload (see
// forgedVariant) with the variant it names. The sink's own keys
// (_leasehold.*) are left out.
func readFinal(ctx context.Context, js jetstream.JetStream, bucket string) (map[string]leasehold.Stamp, map[string]string, error) {
	out := map[string]leasehold.Stamp{}
	forged := map[string]string{}
	prefix := "$KV." + bucket + "."
	err := readStream(ctx, js, "KV_"+bucket, prefix+">", true, false, func(seq uint64, subject string, h nats.Header, data []byte) error {
		key := strings.TrimPrefix(subject, prefix)
		if strings.HasPrefix(key, "_leasehold.") {
			return nil
		}
		switch op, _ := headerValue(h, "KV-Operation"); op {
		case "DEL", "PURGE":
			return nil
		}
		st, err := leasehold.StampFromHeader(h)
		if err != nil {
			return fmt.Errorf("chaos: sink value %s (revision %d) carries no stamp: %w", key, seq, err)
		}
		out[key] = st
		if v := forgedVariant(data); v != "" {
			forged[key] = v
		}
		return nil
	})
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return out, forged, nil
	}
	return out, forged, err
}

func headerValue(h nats.Header, name string) (string, bool) {
	for k, vs := range h {
		if strings.EqualFold(k, name) && len(vs) > 0 {
			return vs[0], true
		}
	}
	return "", false
}

// readRelayDeadLetters reads the effect keys the relays' runner moved to
// the sink's dead-letter stream: effects the receiver refused for good, or
// for longer than the relays' tries last.
func readRelayDeadLetters(ctx context.Context, js jetstream.JetStream) ([]string, error) {
	var out []string
	err := readStream(ctx, js, prefix+"-sink-dlq", prefix+".sinkdlq."+prefix+"-"+relayName, false, true, func(_ uint64, _ string, h nats.Header, _ []byte) error {
		if st, err := leasehold.StampFromHeader(h); err == nil {
			out = append(out, st.Key)
		}
		return nil
	})
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return out, nil
	}
	return out, err
}
