package wmsink

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/sink"
)

// ErrLogNotKept is matched by the error of a message whose log can lose
// messages, or has lost some: a barrier gone from the log cannot be seen,
// and a message after it would be admitted. Such a message is nacked, not
// judged.
var ErrLogNotKept = errors.New("wmsink: the log does not keep its messages")

// ErrHistoryLost is matched by the error of a message older than every
// rise of its fence that the Fencer still keeps (maxRises): it cannot
// tell what the fence was at the message's position. The message is
// nacked, not judged.
var ErrHistoryLost = errors.New("wmsink: the fence's history at this position is no longer kept")

// maxRises bounds the rises kept per fence and log: a message that stays
// unacknowledged across more take-overs of its partition than this is
// held (ErrHistoryLost) rather than judged.
const maxRises = 64

// rise is one entry of a fence's history in a log: from position at on
// (the message at at included), the fence stood at this state.
type rise struct {
	at uint64
	leasehold.FenceState
}

// logState is what the Fencer knows of one log: every message up to read
// has been folded into the fences, whose rises are kept with their
// positions. Only the goroutine holding mu reads or changes it.
type logState struct {
	mu     sync.Mutex
	name   string
	reader *leader.Reader
	kept   bool   // the stream was checked to keep its messages
	read   uint64 // every position up to here is folded
	fences map[leasehold.FenceID]*history
}

// history is one fence's rises in position order, and the position below
// which they were dropped (0: none were).
type history struct {
	rises []rise
	lost  uint64
}

func (f *Fencer) log(stream string) *logState {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := f.logs[stream]
	if l == nil {
		l = &logState{name: stream, reader: leader.NewReader(f.cfg.JetStream, stream), fences: make(map[leasehold.FenceID]*history)}
		f.logs[stream] = l
	}
	return l
}

// at returns fence id as it stood just before position seq.
func (l *logState) at(id leasehold.FenceID, seq uint64) (leasehold.FenceState, error) {
	h := l.fences[id]
	if h == nil {
		return leasehold.FenceState{}, nil
	}
	i := sort.Search(len(h.rises), func(i int) bool { return h.rises[i].at >= seq })
	if i == 0 {
		if h.lost > 0 {
			return leasehold.FenceState{}, fmt.Errorf("%w: log %s position %d, fence %s: its rises before position %d were dropped after %d take-overs",
				ErrHistoryLost, l.name, seq, id, h.rises[0].at, maxRises)
		}
		return leasehold.FenceState{}, nil
	}
	return h.rises[i-1].FenceState, nil
}

// risenAt reports whether fence id rose at position seq.
func (l *logState) risenAt(id leasehold.FenceID, seq uint64) bool {
	h := l.fences[id]
	if h == nil {
		return false
	}
	i := sort.Search(len(h.rises), func(i int) bool { return h.rises[i].at >= seq })
	return i < len(h.rises) && h.rises[i].at == seq
}

// latest returns fence id at the end of what was read.
func (l *logState) latest(id leasehold.FenceID) leasehold.FenceState {
	l.mu.Lock()
	defer l.mu.Unlock()
	if h := l.fences[id]; h != nil && len(h.rises) > 0 {
		return h.rises[len(h.rises)-1].FenceState
	}
	return leasehold.FenceState{}
}

// add records that fence id rose at position r.at, after every rise it
// holds.
func (l *logState) add(id leasehold.FenceID, r rise) error {
	h := l.fences[id]
	if h == nil {
		if len(l.fences) >= MaxFences {
			return fmt.Errorf("%w: log %s holds %d fences, fence %s would be one more", ErrFenceLimit, l.name, MaxFences, id)
		}
		h = &history{}
		l.fences[id] = h
	}
	h.rises = append(h.rises, r)
	if len(h.rises) > maxRises {
		h.lost = h.rises[0].at
		h.rises = append(h.rises[:0], h.rises[1:]...)
	}
	return nil
}

// judgeAt judges the message at pos, stamped st (stamped is false for a
// message without a valid stamp, which only moves the log on), against
// each fence as it stood just before pos. Every message of the log before
// pos is folded first, read from the log where the Fencer has not seen
// it.
func (f *Fencer) judgeAt(ctx context.Context, pos Position, st leasehold.Stamp, stamped bool) (judgement, error) {
	l := f.log(pos.Stream)
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.kept {
		if err := f.checkKept(ctx, l); err != nil {
			return judgement{}, err
		}
		l.kept = true
	}
	if pos.Seq > l.read+1 {
		if err := f.fill(ctx, l, pos.Seq); err != nil {
			return judgement{}, err
		}
	}
	if !stamped {
		if pos.Seq == l.read+1 {
			l.read = pos.Seq
		}
		return judgement{}, nil
	}
	if pos.Seq <= l.read {
		// Folded before (this is a redelivery, or a message the Fencer
		// read from the log first): its verdict is that of its position.
		return f.judgeFolded(ctx, l, pos.Seq, st)
	}
	j, err := f.fold(ctx, l, pos.Seq, st)
	if err != nil {
		return j, err
	}
	l.read = pos.Seq
	return j, nil
}

// fold judges the next message of the log, at seq, and records the rise
// it makes.
func (f *Fencer) fold(ctx context.Context, l *logState, seq uint64, st leasehold.Stamp) (judgement, error) {
	id := st.Fence()
	fs, err := l.at(id, seq)
	if err != nil {
		return judgement{}, err
	}
	j, err := f.judgeChecked(ctx, fs, st)
	if err != nil || j.unverified != nil || j.v != leasehold.Admit || !j.raise {
		return j, err
	}
	if err := l.add(id, rise{at: seq, FenceState: leasehold.FenceState{Epoch: st.Epoch, Acquisition: st.Acquisition, Holder: st.Worker}}); err != nil {
		j.unverified = err
	}
	return j, nil
}

// judgeFolded judges a message at a position already folded: it is judged
// as it was then. A rise it made is in the history; a raise that is not
// was refused when folded (an epoch never issued, a fence beyond the
// limit), and is refused again.
func (f *Fencer) judgeFolded(ctx context.Context, l *logState, seq uint64, st leasehold.Stamp) (judgement, error) {
	id := st.Fence()
	fs, err := l.at(id, seq)
	if err != nil {
		return judgement{}, err
	}
	v, raise := leasehold.Judge(fs, st)
	j := judgement{v: v, raise: raise, fence: fs}
	if v == leasehold.Admit && raise && !l.risenAt(id, seq) {
		j.unverified = fmt.Errorf("%w: scope %s partition %d: epoch %d was refused when position %d of %s was first read; key %q",
			sink.ErrUnverifiedEpoch, st.Scope, st.Partition, st.Epoch, seq, l.name, st.Key)
	}
	return j, nil
}

// fill folds the log's messages after l.read and before upto, read from
// the stream's leader: a direct get could be answered by a replica that is
// behind, and a message it does not have yet would be skipped.
func (f *Fencer) fill(ctx context.Context, l *logState, upto uint64) error {
	for l.read+1 < upto {
		rctx, cancel := context.WithTimeout(ctx, f.cfg.RequestTimeout)
		m, err := l.reader.Next(rctx, l.read+1, ">")
		cancel()
		if err != nil {
			return fmt.Errorf("wmsink: read log %s from position %d: %w", l.name, l.read+1, err)
		}
		if m == nil || m.Seq >= upto {
			l.read = upto - 1
			return nil
		}
		if st, err := leasehold.StampFromHeader(m.Header); err == nil {
			if _, err := f.fold(ctx, l, m.Seq, st); err != nil {
				return fmt.Errorf("wmsink: log %s position %d: %w", l.name, m.Seq, err)
			}
		}
		l.read = m.Seq
	}
	return nil
}

// checkKept refuses a log that can lose messages, or already has: a
// stream that is not limits-retention, has any limit, or no longer starts
// at position 1.
func (f *Fencer) checkKept(ctx context.Context, l *logState) error {
	ctx, cancel := context.WithTimeout(ctx, f.cfg.RequestTimeout)
	defer cancel()
	s, err := f.cfg.JetStream.Stream(ctx, l.name)
	if err != nil {
		return fmt.Errorf("wmsink: look up log %s: %w", l.name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return fmt.Errorf("wmsink: look up log %s: %w", l.name, err)
	}
	c := info.Config
	var lossy []string
	if c.Retention != jetstream.LimitsPolicy {
		lossy = append(lossy, c.Retention.String()+" retention")
	}
	if c.MaxAge > 0 {
		lossy = append(lossy, "MaxAge "+c.MaxAge.String())
	}
	if c.MaxMsgs > 0 {
		lossy = append(lossy, fmt.Sprintf("MaxMsgs %d", c.MaxMsgs))
	}
	if c.MaxBytes > 0 {
		lossy = append(lossy, fmt.Sprintf("MaxBytes %d", c.MaxBytes))
	}
	if c.MaxMsgsPerSubject > 0 {
		lossy = append(lossy, fmt.Sprintf("MaxMsgsPerSubject %d", c.MaxMsgsPerSubject))
	}
	if len(lossy) > 0 {
		return fmt.Errorf("%w: stream %s has %s: a barrier it drops cannot be seen, and a former holder's message after it would be admitted; fence it with a stream that keeps every message (limits retention, no limits), or consume it with the stream sink",
			ErrLogNotKept, l.name, strings.Join(lossy, ", "))
	}
	if first := info.State.FirstSeq; first > 1 {
		return fmt.Errorf("%w: stream %s starts at position %d: the messages before it were purged or deleted, and the barriers among them with them",
			ErrLogNotKept, l.name, first)
	}
	return nil
}
