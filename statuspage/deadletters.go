package statuspage

import (
	"context"
	"errors"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// Dead-letter headers the page reads. Sink dead letters are read by any
// Leasehold-Sink-*Error header, as `leasehold dlq` reads them.
const sinkErrorHeader = "Leasehold-Sink-Error"

func (s *Server) deadLetters(ctx context.Context, d DeadLetterStream) DeadLetters {
	out := DeadLetters{Stream: d.Stream, Recent: []DeadLetter{}}
	st, err := s.cfg.JetStream.Stream(ctx, d.Stream)
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			out.Error = "no such stream (yet)"
		} else {
			out.Error = err.Error()
		}
		return out
	}
	state := st.CachedInfo().State
	out.Count = state.Msgs
	// A worker's dead-letter stream also holds records of what `leasehold
	// dlq replay` and `purge` did and of ranges the job stream removed
	// (worker.RecordSubject): they are no dead letters.
	prefix, workers := strings.CutSuffix(d.Stream, "-dlq")
	if workers {
		if info, err := st.Info(ctx, jetstream.WithSubjectFilter(prefix+".dlq.record.>")); err == nil {
			var records uint64
			for _, n := range info.State.Subjects {
				records += n
			}
			out.Count -= min(records, out.Count)
		}
	}
	if !d.Details {
		return out
	}
	for seq, tries := state.LastSeq, 0; seq >= state.FirstSeq && seq > 0 && len(out.Recent) < 10 && tries < 30; seq, tries = seq-1, tries+1 {
		m, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			out.Error = err.Error()
			break
		}
		if workers && worker.IsRecordSubject(prefix, m.Subject) {
			continue
		}
		dl := DeadLetter{Seq: m.Sequence, Time: m.Time, Subject: truncate(m.Subject)}
		h := m.Header
		// The stamp comes in either form; read it through the parser.
		partition, key := h.Get(leasehold.HeaderPartition), h.Get(leasehold.HeaderKey)
		if st, err := leasehold.StampFromHeader(h); err == nil {
			partition, key = st.Partition.String(), st.Key
		}
		dl.Partition = truncate(partition)
		dl.ID = truncate(h.Get(worker.HeaderJobID))
		if dl.ID == "" {
			dl.ID = truncate(key)
		}
		dl.Error = truncate(h.Get(worker.HeaderError))
		if dl.Error == "" {
			for k, v := range h {
				if strings.HasPrefix(k, "Leasehold-Sink-") && strings.HasSuffix(k, "Error") && len(v) > 0 {
					dl.Error = truncate(v[0])
				}
			}
			if e := h.Get(sinkErrorHeader); e != "" {
				dl.Error = truncate(e)
			}
		}
		out.Recent = append(out.Recent, dl)
	}
	return out
}
