package streamsink

import (
	"context"
	"encoding/json"
	"fmt"
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
	req, _ := json.Marshal(map[string]any{"seq": seq, "next_by_subj": r.filter})
	resp, err := r.js.Conn().RequestWithContext(ctx, r.api+"STREAM.MSG.GET."+r.cfg.Stream, req)
	if err != nil {
		return nil, fmt.Errorf("read the effect log at %d: %w", seq, err)
	}
	var body struct {
		Error   *jetstream.APIError `json:"error"`
		Message *struct {
			Subject string `json:"subject"`
			Seq     uint64 `json:"seq"`
			Header  []byte `json:"hdrs"`
			Data    []byte `json:"data"`
		} `json:"message"`
	}
	if err := json.Unmarshal(resp.Data, &body); err != nil {
		return nil, fmt.Errorf("read the effect log at %d: %w", seq, err)
	}
	if body.Error != nil {
		if body.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound {
			return nil, nil
		}
		return nil, fmt.Errorf("read the effect log at %d: %w", seq, body.Error)
	}
	if body.Message == nil {
		return nil, fmt.Errorf("read the effect log at %d: the answer holds no message", seq)
	}
	m := &logMsg{seq: body.Message.Seq, subject: body.Message.Subject, data: body.Message.Data}
	if len(body.Message.Header) > 0 {
		if m.header, err = nats.DecodeHeadersMsg(body.Message.Header); err != nil {
			return nil, fmt.Errorf("read the effect log at %d: decode headers: %w", seq, err)
		}
	}
	return m, nil
}

func apiPrefix(o jetstream.JetStreamOptions) string {
	switch {
	case o.Domain != "":
		return "$JS." + o.Domain + ".API."
	case o.APIPrefix != "":
		if !strings.HasSuffix(o.APIPrefix, ".") {
			return o.APIPrefix + "."
		}
		return o.APIPrefix
	default:
		return jetstream.DefaultAPIPrefix
	}
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
