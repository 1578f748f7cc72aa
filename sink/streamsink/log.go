package streamsink

import (
	"context"
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
)

// logMsg is one message of the effect log, delivered by the consumer or
// read from the stream.
type logMsg struct {
	seq     uint64
	subject string
	header  nats.Header
	data    []byte
	msg     *nats.Msg // a delivery of the consumer; nil when read from the stream
}

// next reads, from the stream leader, the first log message at or after
// seq that the runner consumes, or returns nil when there is none. A direct
// get could be answered by a follower that is behind, and skipping a
// message it does not have yet would lose it.
func (r *Runner) next(ctx context.Context, seq uint64) (*logMsg, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
	defer cancel()
	m, err := r.leader.Next(ctx, seq, r.filter)
	if err != nil || m == nil {
		return nil, err
	}
	return &logMsg{seq: m.Seq, subject: m.Subject, data: m.Data, header: m.Header}, nil
}

// headerGet returns the first value of name, matched without regard to
// case.
func headerGet(h nats.Header, name string) (string, bool) {
	if vs, ok := h[name]; ok && len(vs) > 0 {
		return vs[0], true
	}
	for k, vs := range h {
		if len(k) == len(name) && len(vs) > 0 && strings.EqualFold(k, name) {
			return vs[0], true
		}
	}
	return "", false
}

// keepHeader reports whether a log message's header travels with its
// republished effect: leasehold's own (but the stamp's, which the stamp
// writes in canonical form, and HeaderPack, which no single effect
// carries) and W3C trace context. Nothing else: a header in the server's
// Nats- namespace changes how the server takes the write
// (Nats-Expected-Stream fails it for ever, a Nats-Msg-Id has a later
// effect dropped as its duplicate), and other headers are the publisher's
// business, not the sink's. The job mark travels as it came: the effect's
// own (an effect of a packed message carries the mark it would have
// carried alone, see packed.go).
func keepHeader(name string) bool {
	const lh = "Leasehold-"
	if len(name) > len(lh) && strings.EqualFold(name[:len(lh)], lh) {
		for i := len(lh); i < len(name); i++ {
			if c := name[i]; c <= ' ' || c >= 0x7f || c == ':' {
				return false
			}
		}
		return !isStampHeader(name) && !(len(name) == len(leasehold.HeaderPack) && strings.EqualFold(name, leasehold.HeaderPack))
	}
	return strings.EqualFold(name, "traceparent") || strings.EqualFold(name, "tracestate") || strings.EqualFold(name, "baggage")
}

// isCanonicalStampHeader reports whether name is a stamp header spelled as
// leasehold spells it, in either form: the common case, told without
// folding case, copied as it came (the stamp was read from it, and a
// compact stamp has one spelling).
func isCanonicalStampHeader(name string) bool {
	switch name {
	case leasehold.HeaderScope, leasehold.HeaderPartition, leasehold.HeaderEpoch, leasehold.HeaderAcquisition, leasehold.HeaderKey, leasehold.HeaderWorker,
		leasehold.HeaderStamp:
		return true
	}
	return false
}

// isStampHeader reports whether name is a stamp header, in either form
// and any spelling: the job mark's headers are not.
func isStampHeader(name string) bool {
	for _, h := range [...]string{leasehold.HeaderScope, leasehold.HeaderPartition, leasehold.HeaderEpoch, leasehold.HeaderAcquisition, leasehold.HeaderKey, leasehold.HeaderWorker, leasehold.HeaderStamp} {
		if len(name) == len(h) && strings.EqualFold(name, h) {
			return true
		}
	}
	return false
}
