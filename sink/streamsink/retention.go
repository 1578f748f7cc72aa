package streamsink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/retry"
)

// ErrNoLog is matched by the error New returns when the effect log does
// not exist and Config.Provision is off.
var ErrNoLog = errors.New("streamsink: the effect log does not exist")

// ErrTrimmedLog is matched by the error New returns for an effect log whose
// settings can remove messages the runner has not handled, when
// Config.AllowTrimming is off.
var ErrTrimmedLog = errors.New("streamsink: the effect log can remove messages the runner has not handled")

// Retention is what the effect log's settings allow its server to remove,
// as New found them. A runner that falls further behind than they allow
// meets a gap (see ErrGap).
type Retention struct {
	// MaxAge removes messages older than it; 0 never.
	MaxAge time.Duration
	// MaxMsgs and MaxBytes, with DiscardOld, remove the oldest messages
	// beyond them; 0 when they remove nothing.
	MaxMsgs, MaxBytes int64
	// MaxMsgsPerSubject removes a subject's oldest messages beyond it,
	// from anywhere in the log; 0 when it removes nothing.
	MaxMsgsPerSubject int64
	// MsgTTL: publishers may give messages a time to live of their own.
	MsgTTL bool
	// Acked: the log removes messages once consumed (a work-queue or
	// interest retention).
	Acked bool
	// Deletable: DenyDelete or DenyPurge is off, so that anyone allowed
	// to may remove messages by hand.
	Deletable bool
}

// Trims reports whether the log's limits remove messages by themselves.
func (t Retention) Trims() bool {
	return t.MaxAge > 0 || t.MaxMsgs > 0 || t.MaxBytes > 0 || t.MaxMsgsPerSubject > 0 || t.MsgTTL || t.Acked
}

// String states the bound: how far behind a runner may fall before
// messages it needs are gone.
func (t Retention) String() string {
	var bounds []string
	if t.MaxAge > 0 {
		bounds = append(bounds, fmt.Sprintf("handle each message within %v of its publication (MaxAge): a sink may be down for at most that, less its lag", t.MaxAge))
	}
	if t.MaxMsgs > 0 {
		bounds = append(bounds, fmt.Sprintf("stay fewer than %d messages behind (MaxMsgs, DiscardOld)", t.MaxMsgs))
	}
	if t.MaxBytes > 0 {
		bounds = append(bounds, fmt.Sprintf("stay fewer than %d bytes behind (MaxBytes, DiscardOld)", t.MaxBytes))
	}
	if t.MaxMsgsPerSubject > 0 {
		bounds = append(bounds, fmt.Sprintf("stay fewer than %d messages of any subject behind (MaxMsgsPerSubject)", t.MaxMsgsPerSubject))
	}
	if t.MsgTTL {
		bounds = append(bounds, "handle each message within the time to live its publisher gave it (AllowMsgTTL)")
	}
	if t.Acked {
		bounds = append(bounds, "hold no job open across a restart (the log removes what is acked)")
	}
	s := "a sink may be down for any time: the log's limits remove nothing"
	if len(bounds) > 0 {
		s = "a sink must " + strings.Join(bounds, ", and ")
	}
	if t.Deletable {
		s += "; DenyDelete or DenyPurge is off, so a message removed by hand makes a gap at any time"
	}
	return s
}

func retentionOf(c jetstream.StreamConfig) Retention {
	t := Retention{
		MaxAge:    c.MaxAge,
		MsgTTL:    c.AllowMsgTTL,
		Acked:     c.Retention != jetstream.LimitsPolicy,
		Deletable: !c.DenyDelete || !c.DenyPurge,
	}
	if c.Discard == jetstream.DiscardOld {
		t.MaxMsgs, t.MaxBytes = max(c.MaxMsgs, 0), max(c.MaxBytes, 0)
	}
	// The per-subject limit removes old messages whatever the discard
	// policy, unless new ones are refused per subject.
	if c.MaxMsgsPerSubject > 0 && !(c.Discard == jetstream.DiscardNew && c.DiscardNewPerSubject) {
		t.MaxMsgsPerSubject = c.MaxMsgsPerSubject
	}
	return t
}

// Retention returns what the effect log's settings allow its server to
// remove, as New found them, and so how far behind the runner may fall.
func (r *Runner) Retention() Retention { return r.retention }

// provisionLog finds the effect log, or creates it with Config.Provision,
// and checks what its settings can remove.
func (r *Runner) provisionLog(ctx context.Context) error {
	cfg := r.cfg
	s, err := retry.Value(ctx, r.lookup(cfg.Stream))
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		if !cfg.Provision {
			return fmt.Errorf("%w: %s: run `leasehold init` first (it creates the job streams and their effect log), or set Config.Provision to have the runner create a log that no job stream provisions", ErrNoLog, cfg.Stream)
		}
		s, err = r.create(ctx, jetstream.StreamConfig{
			Name: cfg.Stream, Subjects: cfg.Subjects, Storage: jetstream.FileStorage, Replicas: cfg.Replicas,
			Description: "leasehold effect log",
			// Trimmed by nothing and never by hand: a message the runner
			// has not handled cannot go missing.
			DenyDelete: true, DenyPurge: true,
		})
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			s, err = retry.Value(ctx, r.lookup(cfg.Stream))
		}
		if err != nil {
			return fmt.Errorf("streamsink: create the effect log %s: %w", cfg.Stream, err)
		}
	} else if err != nil {
		return fmt.Errorf("streamsink: look up the effect log %s: %w", cfg.Stream, err)
	}
	sc := s.CachedInfo().Config
	r.retention = retentionOf(sc)
	r.logFirst = max(sc.FirstSeq, 1)
	if r.retention.Trims() && !cfg.AllowTrimming {
		return fmt.Errorf("%w: %s: %s; a runner that falls behind that loses messages, and one of them may be a take-over's barrier: remove those limits (`nats stream edit`), or set Config.AllowTrimming to run with them, knowing that the runner then stops at a gap until an operator resumes it",
			ErrTrimmedLog, cfg.Stream, r.retention)
	}
	if r.retention.Trims() || r.retention.Deletable {
		r.log.LogAttrs(ctx, slog.LevelWarn, "streamsink: the effect log can lose messages the runner has not handled; the runner stops at such a gap",
			slog.String("sink", cfg.Name), slog.String("stream", cfg.Stream), slog.String("bound", r.retention.String()))
	}
	return nil
}

// provisionDeadLetter finds or creates the dead-letter stream and checks
// that it stores the runner's dead-letter subject.
func (r *Runner) provisionDeadLetter(ctx context.Context) error {
	cfg := r.cfg
	if _, err := retry.Value(ctx, r.lookup(cfg.DeadLetter)); errors.Is(err, jetstream.ErrStreamNotFound) {
		_, err = r.create(ctx, jetstream.StreamConfig{
			Name: cfg.DeadLetter, Subjects: []string{cfg.Prefix + ".sinkdlq.>"}, Storage: jetstream.FileStorage,
			Replicas: cfg.Replicas, Duplicates: 10 * time.Minute, Description: "leasehold sink dead letters: effects a sink could not apply",
		})
		if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return fmt.Errorf("streamsink: create the dead-letter stream %s: %w", cfg.DeadLetter, err)
		}
	} else if err != nil {
		return fmt.Errorf("streamsink: look up the dead-letter stream %s: %w", cfg.DeadLetter, err)
	}
	name, err := r.js.StreamNameBySubject(ctx, cfg.DeadLetterSubject)
	if err != nil || name != cfg.DeadLetter {
		return fmt.Errorf("streamsink: the dead-letter subject %s is not stored by the dead-letter stream %s (found %q, %v): set Config.DeadLetterSubject to one of its subjects", cfg.DeadLetterSubject, cfg.DeadLetter, name, err)
	}
	return nil
}
