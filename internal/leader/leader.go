// Package leader reads stream messages through the stream leader.
//
// JetStream's direct get (what kv.Get and Stream.GetMsg use on a stream
// with AllowDirect) may be answered by any replica, including one that is
// behind. Ownership, fences and log positions must never be decided from a
// stale read, so leasehold reads those through the non-direct message-get
// API, which only the stream leader answers.
package leader

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Msg is a stream message as the leader returned it.
type Msg struct {
	Subject string
	Seq     uint64
	Header  nats.Header
	Data    []byte
	Time    time.Time
}

// Reader reads one stream through its leader.
type Reader struct {
	nc      *nats.Conn
	subject string // $JS.API.STREAM.MSG.GET.<stream>, with the account's API prefix
	stream  string
	timeout time.Duration // bounds a request whose context has no deadline
}

// NewReader returns a Reader of stream over js's connection, honouring its
// API prefix or domain. A read whose context has no deadline is bounded by
// js's default timeout, as jetstream bounds its own API calls.
func NewReader(js jetstream.JetStream, stream string) *Reader {
	o := js.Options()
	timeout := o.DefaultTimeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	return &Reader{nc: js.Conn(), subject: APIPrefix(o) + "STREAM.MSG.GET." + stream, stream: stream, timeout: timeout}
}

// Last returns the last message on subject, or nil when the subject holds
// none.
func (r *Reader) Last(ctx context.Context, subject string) (*Msg, error) {
	return r.get(ctx, map[string]any{"last_by_subj": subject}, subject)
}

// Next returns the first message at or after seq on subjects matching
// filter (a wildcard subject; "" for all), or nil when there is none.
func (r *Reader) Next(ctx context.Context, seq uint64, filter string) (*Msg, error) {
	req := map[string]any{"seq": seq}
	if filter != "" {
		req["next_by_subj"] = filter
	}
	return r.get(ctx, req, fmt.Sprintf("position %d", seq))
}

func (r *Reader) get(ctx context.Context, req map[string]any, what string) (*Msg, error) {
	// Core NATS requests are at most once: a request written just before
	// the server goes away, or whose answer is lost in a reconnect, is
	// never answered and never failed, so without a deadline its caller
	// waits for ever while the connection is healthy again.
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.timeout)
		defer cancel()
	}
	body, _ := json.Marshal(req)
	resp, err := r.nc.RequestWithContext(ctx, r.subject, body)
	if err != nil {
		return nil, fmt.Errorf("read %s of stream %s from its leader: %w", what, r.stream, err)
	}
	var ans struct {
		Error   *jetstream.APIError `json:"error"`
		Message *struct {
			Subject string    `json:"subject"`
			Seq     uint64    `json:"seq"`
			Header  []byte    `json:"hdrs"`
			Data    []byte    `json:"data"`
			Time    time.Time `json:"time"`
		} `json:"message"`
	}
	if err := json.Unmarshal(resp.Data, &ans); err != nil {
		return nil, fmt.Errorf("read %s of stream %s: decode the answer: %w", what, r.stream, err)
	}
	if ans.Error != nil {
		if ans.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound {
			return nil, nil
		}
		return nil, fmt.Errorf("read %s of stream %s from its leader: %w", what, r.stream, ans.Error)
	}
	if ans.Message == nil {
		return nil, fmt.Errorf("read %s of stream %s: the answer holds no message", what, r.stream)
	}
	m := &Msg{Subject: ans.Message.Subject, Seq: ans.Message.Seq, Data: ans.Message.Data, Time: ans.Message.Time}
	if len(ans.Message.Header) > 0 {
		if m.Header, err = nats.DecodeHeadersMsg(ans.Message.Header); err != nil {
			return nil, fmt.Errorf("read %s of stream %s: decode headers: %w", what, r.stream, err)
		}
	}
	return m, nil
}

// IsMarker reports whether a KV message with these headers is a delete,
// purge or expiry marker rather than a value.
func IsMarker(h nats.Header) bool {
	if len(h) == 0 {
		return false
	}
	switch h.Get("KV-Operation") {
	case "DEL", "PURGE":
		return true
	}
	return h.Get(jetstream.MarkerReasonHeader) != ""
}

// APIPrefix is the JetStream API subject prefix of o: the domain's, the
// configured prefix, or the default.
func APIPrefix(o jetstream.JetStreamOptions) string {
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
