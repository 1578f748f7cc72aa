package streamsink

import (
	"context"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// logMsg is one message of the effect log, delivered by the consumer or
// read from the stream.
type logMsg struct {
	seq     uint64
	subject string
	header  nats.Header
	data    []byte
	msg     jetstream.Msg // nil when read from the stream
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
		if strings.EqualFold(k, name) && len(vs) > 0 {
			return vs[0], true
		}
	}
	return "", false
}
