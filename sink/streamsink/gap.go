package streamsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// ErrGap is matched by the error of a runner stopped at a gap: messages of
// its log between the position it handled and the next one it has were
// removed (trimmed by the log's limits, which Config.AllowTrimming
// accepts, or deleted by hand) before it handled them. One of them may
// have been a take-over's barrier, and effects after it judged without it
// could apply a zombie's writes, so the runner applies nothing past the
// gap: Run waits there, Ready returns a *GapError, and the
// leasehold_sink_gap gauge is 1, until an operator decides to go on
// (Runner.ResumeAfterGap).
var ErrGap = errors.New("streamsink: a gap in the effect log")

// GapError reports a gap: log positions From to To (both included) hold no
// message the runner can read, and some of them held messages that were
// removed before it handled them.
type GapError struct {
	Stream   string
	From, To uint64
	// Filtered is set when the runner consumes part of the log: the
	// removed messages may all have been of other subjects, since the
	// server keeps no record of what it removed.
	Filtered bool
}

func (e *GapError) Error() string {
	which := "messages the runner had not handled"
	if e.Filtered {
		which = "messages that may have been of the runner's filter"
	}
	return fmt.Sprintf("streamsink: log %s lost positions %d to %d before the runner handled them: %s were removed (trimmed by the log's limits or deleted by hand). "+
		"One may have been a take-over's barrier, so the runner applies nothing past them. Find out what was lost (the jobs committed at that time), then resume past the gap on purpose: "+
		"Runner.ResumeAfterGap(ctx, %d), or `leasehold sink --resume-gap %d`; to keep it from happening again, let the runner fall less far behind or raise the log's limits (see Runner.Retention)",
		e.Stream, e.From, e.To, which, e.To, e.To)
}

// Is makes errors.Is(err, ErrGap) true.
func (e *GapError) Is(target error) bool { return target == ErrGap }

// skip is an operator's resume past a gap, kept in the position record.
type skip struct {
	From uint64    `json:"from"`
	To   uint64    `json:"to"`
	At   time.Time `json:"at"`
}

// maxSkips bounds the skips the position record keeps: the latest.
const maxSkips = 16

// checkStart reports a gap below the log's first message: positions after
// the saved one that the log no longer holds. Nothing may arrive to show
// it otherwise.
func (r *Runner) checkStart(ctx context.Context) error {
	st, err := r.logState(ctx, false)
	if err != nil {
		return err
	}
	from := max(r.seq+1, r.logFirst)
	if st.FirstSeq > from {
		return &GapError{Stream: r.cfg.Stream, From: from, To: st.FirstSeq - 1, Filtered: !r.wholeLog}
	}
	return nil
}

// checkGap is called when the runner's next message is at to+1 and the
// log holds no message of the runner's from from to to: it reports a gap
// if any of those positions was removed. When the runner consumes the
// whole log, every one was.
func (r *Runner) checkGap(ctx context.Context, from, to uint64) error {
	from = max(from, r.logFirst)
	if from > to {
		return nil
	}
	gap := &GapError{Stream: r.cfg.Stream, From: from, To: to, Filtered: !r.wholeLog}
	if r.wholeLog {
		return gap
	}
	// Read after the caller found none of the runner's messages there:
	// positions the log still holds now held other subjects' messages
	// then, since nothing comes back once removed.
	st, err := r.logState(ctx, false)
	if err != nil {
		return err
	}
	if st.FirstSeq > from {
		return gap
	}
	if st.NumDeleted == 0 {
		return nil
	}
	if st, err = r.logState(ctx, true); err != nil {
		return err
	}
	for _, d := range st.Deleted {
		if d >= from && d <= to {
			return gap
		}
	}
	return nil
}

func (r *Runner) logState(ctx context.Context, deleted bool) (jetstream.StreamState, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
	defer cancel()
	info, err := r.logStream.Info(ctx, jetstream.WithDeletedDetails(deleted))
	if err != nil {
		return jetstream.StreamState{}, fmt.Errorf("read the state of %s: %w", r.cfg.Stream, err)
	}
	return info.State, nil
}

// stopAt records that the runner stopped at gap and says so. It is called
// with stepMu held. The gauge is set before Ready can see the gap, so that
// whoever sees the gap in Ready sees it in the gauge too; it is not set
// under mu, since the gauge's first use registers a metrics callback,
// which waits for a collection that may be waiting for mu.
func (r *Runner) stopAt(ctx context.Context, gap *GapError) {
	r.mu.Lock()
	known := r.gap != nil
	r.mu.Unlock()
	if !known {
		r.rep.Telemetry().Metrics.SetSinkGap(r.cfg.Name, true)
	}
	r.mu.Lock()
	r.gap = gap
	r.mu.Unlock()
	if known {
		return
	}
	r.log.LogAttrs(ctx, slog.LevelError, "streamsink: stopped at a gap in the effect log; nothing past it is applied until an operator resumes",
		slog.String("sink", r.cfg.Name), slog.String("stream", r.cfg.Stream), slog.Uint64("from", gap.From), slog.Uint64("to", gap.To),
		slog.Bool("filtered", gap.Filtered), slog.String("bound", r.retention.String()), slog.Any("error", gap))
}

// gapWait returns the gap the runner stopped at, if any, and a channel
// closed when it is resumed.
func (r *Runner) gapWait() (*GapError, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.gap, r.resumed
}

// ResumeAfterGap is an operator's decision to go on past a gap: whatever
// the log lost up to position to is given up for lost, the skip is
// recorded in the saved state and logged, and a runner stopped at the gap
// goes on (Run need not be running). Effects after the gap are judged
// without whatever barrier it held: an effect of a holder that lost its
// partition there can be applied.
//
// It refuses to skip a message of the runner's that the log still holds,
// or positions beyond the log's last one (messages that arrive later must
// be handled). A position at or below the one handled skips nothing and
// returns nil, so that the same resume given to each start is harmless.
func (r *Runner) ResumeAfterGap(ctx context.Context, to uint64) error {
	r.stepMu.Lock()
	defer r.stepMu.Unlock()
	from := r.seq + 1
	if to < from {
		return nil
	}
	st, err := r.logState(ctx, false)
	if err != nil {
		return fmt.Errorf("streamsink: resume after the gap: %w", err)
	}
	if to > st.LastSeq {
		return fmt.Errorf("streamsink: resume after the gap up to %d: the log %s ends at %d, and messages that come later must be handled: resume up to the gap's end (GapError.To)", to, r.cfg.Stream, st.LastSeq)
	}
	m, err := r.next(ctx, from)
	if err != nil {
		return fmt.Errorf("streamsink: resume after the gap: read %s: %w", r.cfg.Stream, err)
	}
	if m != nil && m.seq <= to {
		return fmt.Errorf("streamsink: resume after the gap up to %d: the log %s still holds the runner's message at %d, which must be handled: resume up to %d at most", to, r.cfg.Stream, m.seq, m.seq-1)
	}
	r.skips = append(r.skips, skip{From: from, To: to, At: time.Now().UTC()})
	if len(r.skips) > maxSkips {
		r.skips = slices.Delete(r.skips, 0, len(r.skips)-maxSkips)
	}
	// Open jobs are given up with what the gap took.
	r.resetGroups()
	w := &work{seq: to}
	written, err := r.save(ctx, w)
	if err != nil {
		r.skips = r.skips[:len(r.skips)-1]
		return fmt.Errorf("streamsink: resume after the gap: %w", err)
	}
	r.adopt(w, written)
	r.mu.Lock()
	gap := r.gap
	r.gap = nil
	close(r.resumed)
	r.resumed = make(chan struct{})
	r.mu.Unlock()
	if gap != nil {
		r.rep.Telemetry().Metrics.SetSinkGap(r.cfg.Name, false)
	}
	r.log.LogAttrs(ctx, slog.LevelWarn, "streamsink: resumed past a gap on an operator's decision; whatever the log lost there is not applied",
		slog.String("sink", r.cfg.Name), slog.String("stream", r.cfg.Stream), slog.Uint64("from", from), slog.Uint64("to", to))
	return nil
}
