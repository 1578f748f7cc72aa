package kvsink

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

type entryKind int

const (
	entryNone   entryKind = iota // no message on the key
	entryValue                   // a live value
	entryMarker                  // a delete, purge or expiry marker
)

// entry is the last message on a key, as the stream leader sees it.
type entry struct {
	subject string
	kind    entryKind
	rev     uint64
	data    []byte
	header  nats.Header
}

// last reads the last message on key through the stream leader: a direct
// get may be answered by a follower that is behind, and a decision taken
// on it would only cost a refused write and a retry, but MaxEpoch must not
// go back.
func (s *Sink) last(ctx context.Context, key string) (entry, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	req, _ := json.Marshal(map[string]string{"last_by_subj": s.prefix + key})
	msg, err := s.js.Conn().RequestWithContext(ctx, s.api+"STREAM.MSG.GET."+s.stream, req)
	if err != nil {
		return entry{}, fmt.Errorf("kvsink: read %s from the stream leader: %w", key, err)
	}
	var resp struct {
		Error   *jetstream.APIError `json:"error"`
		Message *struct {
			Seq    uint64 `json:"seq"`
			Header string `json:"hdrs"`
			Data   string `json:"data"`
		} `json:"message"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return entry{}, fmt.Errorf("kvsink: read %s: decode the answer: %w", key, err)
	}
	if resp.Error != nil {
		if resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound {
			return entry{subject: key, kind: entryNone}, nil
		}
		return entry{}, fmt.Errorf("kvsink: read %s from the stream leader: %w", key, resp.Error)
	}
	if resp.Message == nil {
		return entry{}, fmt.Errorf("kvsink: read %s: the answer holds no message", key)
	}
	e := entry{subject: key, kind: entryValue, rev: resp.Message.Seq}
	if resp.Message.Header != "" {
		raw, err := base64.StdEncoding.DecodeString(resp.Message.Header)
		if err != nil {
			return entry{}, fmt.Errorf("kvsink: read %s: decode headers: %w", key, err)
		}
		if e.header, err = nats.DecodeHeadersMsg(raw); err != nil {
			return entry{}, fmt.Errorf("kvsink: read %s: decode headers: %w", key, err)
		}
		switch e.header.Get("KV-Operation") {
		case "DEL", "PURGE":
			e.kind = entryMarker
		}
		if e.header.Get(jetstream.MarkerReasonHeader) != "" {
			e.kind = entryMarker
		}
	}
	if e.data, err = base64.StdEncoding.DecodeString(resp.Message.Data); err != nil {
		return entry{}, fmt.Errorf("kvsink: read %s: decode data: %w", key, err)
	}
	return e, nil
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
