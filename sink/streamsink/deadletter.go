package streamsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// ErrPoison, matched by a Handler's or BatchHandler's error, says that the
// effect can never be applied however often it is tried: the runner moves
// it to the dead-letter stream at once instead of after
// Config.MaxDeliveries tries.
var ErrPoison = errors.New("streamsink: the effect can never be applied")

// Headers a dead letter carries beside the effect's stamp, its other
// leasehold headers and its trace context.
const (
	HeaderSinkName     = "Leasehold-Sink-Name"     // the sink (Config.Name)
	HeaderSinkLog      = "Leasehold-Sink-Log"      // the effect log (Config.Stream)
	HeaderSinkSubject  = "Leasehold-Sink-Subject"  // the effect's subject in the log
	HeaderSinkPosition = "Leasehold-Sink-Position" // the effect's log position
	HeaderSinkTries    = "Leasehold-Sink-Tries"    // deliveries tried, all failed
	HeaderSinkError    = "Leasehold-Sink-Error"    // the last failure, on one line
	// HeaderSinkData is set to "omitted" when the effect's data did not
	// fit in a dead letter beside the headers, and to "omitted, and the
	// effect's headers" when its own headers (trace context, leasehold's
	// other than its stamp and job mark) did not fit either: read it at
	// its log position.
	HeaderSinkData = "Leasehold-Sink-Data"
)

// maxSinkError bounds the error text of a dead letter, so that its
// headers stay within leasehold.SinkHeaderRoom.
const maxSinkError = 512

// deadLettered marks, in Runner.tries, an effect moved to the dead-letter
// stream whose progress is not saved yet: decided again after a failed
// save, it is not tried or moved again.
const deadLettered = -1

// effectAt names one effect of the log: its position and its idempotency
// key. A packed message (leasehold.HeaderPack) holds several effects at
// one position, so the position alone does not tell them apart.
type effectAt struct {
	seq uint64
	key string
}

// at names o's effect.
func (o *outcome) at() effectAt { return effectAt{seq: o.m.seq, key: o.d.Stamp.Key} }

// failed counts a failed delivery of effect e and returns how many failed
// in a row.
func (r *Runner) failed(e effectAt) int {
	r.tries[e]++
	return r.tries[e]
}

// delivered forgets the failures of effect e.
func (r *Runner) delivered(e effectAt) {
	r.deliveredAt.Store(time.Now().UnixNano())
	if len(r.tries) > 0 {
		delete(r.tries, e)
	}
}

// forgetTries drops the counts of positions at or below the saved one.
func (r *Runner) forgetTries(saved uint64) {
	for e := range r.tries {
		if e.seq <= saved {
			delete(r.tries, e)
		}
	}
}

// isSinkHeader reports whether name is one of the headers a dead letter
// adds: an effect's own copy is not carried over.
func isSinkHeader(name string) bool {
	const p = "Leasehold-Sink-"
	return len(name) >= len(p) && strings.EqualFold(name[:len(p)], p)
}

// deadLetter moves the accepted effect of o to the dead-letter stream after
// tries failed deliveries, the last with cause, and marks it DeadLettered.
// It retries the publish until it is stored or ctx ends: the effect is
// counted as handled only once its dead letter is stored.
func (r *Runner) deadLetter(ctx context.Context, o *outcome, tries int, cause error) error {
	seq, at := o.m.seq, o.at()
	o.deliver = false
	o.d.Outcome = sink.DeadLettered
	o.d.Err = fmt.Errorf("streamsink: the effect at log position %d (subject %s, key %q) was moved to the dead-letter stream %s after %d failed tries: %w",
		seq, o.m.subject, o.d.Stamp.Key, r.cfg.DeadLetter, tries, cause)
	if r.tries[at] == deadLettered {
		return nil // stored by an earlier try of this batch
	}
	msg := r.deadLetterMsg(o, tries, cause)
	trimmed := false // the effect's headers dropped from msg
	for attempt := 0; ; attempt++ {
		pctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
		_, err := jspub.Publish(pctx, r.js, msg)
		cancel()
		if errors.Is(err, nats.ErrMaxPayload) && msg.Data != nil {
			// The effect fitted in the log; with the headers added it
			// does not: the log keeps it.
			msg.Data = nil
			msg.Header.Set(HeaderSinkData, "omitted")
			continue
		}
		if (errors.Is(err, nats.ErrMaxPayload) || headerTooLarge(err)) && !trimmed {
			// Its own headers kept (trace context, leasehold's) fill the
			// message even without the data, or pass what a stream takes
			// in headers (64 KiB): no retry makes it fit. The
			// stamp, the job mark and the sink's headers say what the
			// effect was and where the log keeps it whole.
			trimmed = true
			for k := range msg.Header {
				if !isStampHeader(k) && !leasehold.IsStampHeader(k) && !isSinkHeader(k) {
					delete(msg.Header, k)
				}
			}
			msg.Header.Set(HeaderSinkData, "omitted, and the effect's headers")
			continue
		}
		if err == nil {
			break
		}
		if err := r.backoff(ctx, attempt, "dead-letter", err); err != nil {
			return err
		}
	}
	r.tries[at] = deadLettered
	r.log.LogAttrs(o.ctx, slog.LevelError, "streamsink: effect dead-lettered: it could not be delivered",
		slog.String("sink", r.cfg.Name), slog.Uint64("position", seq), slog.String("subject", o.m.subject),
		slog.String("scope", o.d.Stamp.Scope), slog.Uint64("partition", uint64(o.d.Stamp.Partition)), slog.String("key", o.d.Stamp.Key),
		slog.Int("tries", tries), slog.String("dlq", r.cfg.DeadLetterSubject), slog.Any("error", cause))
	return nil
}

// deadLetterMsg builds the dead letter of o: its data, stamp, leasehold
// headers and trace context (never a Nats- header, which would direct the
// server), and the Leasehold-Sink-* headers.
func (r *Runner) deadLetterMsg(o *outcome, tries int, cause error) *nats.Msg {
	out := nats.NewMsg(r.cfg.DeadLetterSubject)
	for k, vs := range o.m.header {
		if keepHeader(k) && !isSinkHeader(k) {
			out.Header[k] = vs
		}
	}
	o.d.Stamp.SetHeader(out.Header)
	r.rep.Telemetry().Propagator.Inject(o.ctx, telemetry.HeaderCarrier(out.Header))
	out.Header.Set(HeaderSinkName, oneLine(r.cfg.Name, 256))
	out.Header.Set(HeaderSinkLog, r.cfg.Stream)
	out.Header.Set(HeaderSinkSubject, o.m.subject)
	out.Header.Set(HeaderSinkPosition, strconv.FormatUint(o.m.seq, 10))
	out.Header.Set(HeaderSinkTries, strconv.Itoa(tries))
	out.Header.Set(HeaderSinkError, oneLine(cause.Error(), maxSinkError))
	out.Data = o.m.data
	return out
}

// headerTooLarge reports whether a stream refused a message for headers
// larger than it takes (JetStream API error 10097: more than 64 KiB).
func headerTooLarge(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jsHeaderTooLarge
}

// jsHeaderTooLarge is JetStream's error code for headers above 64 KiB.
const jsHeaderTooLarge jetstream.ErrorCode = 10097

// oneLine makes s fit a header value: printable, at most n bytes.
func oneLine(s string, n int) string {
	b := []byte(s)
	for i, c := range b {
		if c < ' ' || c == 0x7f {
			b[i] = ' '
		}
	}
	if len(b) > n {
		b = append(b[:n-3], "..."...)
	}
	return string(b)
}
