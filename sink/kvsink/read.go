package kvsink

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold/internal/leader"
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
	m, err := s.leader.Last(ctx, s.prefix+key)
	if err != nil {
		return entry{}, fmt.Errorf("kvsink: %w", err)
	}
	if m == nil {
		return entry{subject: key, kind: entryNone}, nil
	}
	e := entry{subject: key, kind: entryValue, rev: m.Seq, data: m.Data, header: m.Header}
	if leader.IsMarker(m.Header) {
		e.kind = entryMarker
	}
	return e, nil
}
