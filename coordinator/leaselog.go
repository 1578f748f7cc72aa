package coordinator

import (
	"context"
	"log/slog"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Log lines of a lease's life. They carry only the fields that have a
// value, and name a membership registration as such: it is no partition.

// prior is what a lease key held when an acquisition wrote it, as far as
// the acquirer saw: it tells a hand-off from a take-over.
type prior int

const (
	priorUnknown  prior = iota // not known: the key was written at a revision read elsewhere
	priorFree                  // nothing: never held, or its marker has expired since
	priorReleased              // the marker of a release: the last holder gave the lease up
	priorLost                  // the lease of a holder that did not let go: its session ended, it expired, or its record outlived it
)

// markerPrior reads a marker's headers: a release purges the key
// (KV-Operation: PURGE), the server marks a record that expired
// (Nats-Marker-Reason: MaxAge).
func markerPrior(h nats.Header) prior {
	switch {
	case h.Get(jetstream.MarkerReasonHeader) == "MaxAge":
		return priorLost
	case h.Get("KV-Operation") == "PURGE":
		return priorReleased
	}
	return priorUnknown
}

// logAcquired logs an acquisition: at INFO for a partition or a lock, with
// the holder it came from and that holder's epoch when the fence record
// names one. The words are the status page's: "handed off" when the last
// holder released it, "took over" when its lease ended without a release
// (a crash, a freeze, a cut-off); "acquired" when nobody held it, or
// nothing says how it was let go.
func (l *Lease) logAcquired() {
	log := l.c.cfg.Logger
	ctx := context.Background()
	attrs := make([]slog.Attr, 0, 6)
	switch l.kind {
	case kindMember:
		return // the group logs joining and leaving
	case kindLock:
		attrs = append(attrs, slog.String("lock", l.name))
	default:
		attrs = append(attrs, slog.Uint64("partition", uint64(l.info.Partition)))
	}
	attrs = append(attrs, slog.Uint64("epoch", uint64(l.info.Epoch)), slog.String("worker", l.info.Holder))
	msg := "acquired " + l.what()
	if prev := l.previous; prev.Holder != "" {
		switch l.prior {
		case priorReleased:
			msg = l.what() + " handed off"
		case priorLost:
			msg = "took over " + l.what()
		}
		attrs = append(attrs, slog.String("from", prev.Holder))
		if prev.Epoch != 0 {
			attrs = append(attrs, slog.Uint64("previous_epoch", prev.Epoch))
		}
	}
	log.LogAttrs(ctx, slog.LevelInfo, msg, attrs...)
}

// logLost logs the loss of the lease, with who holds it now and the
// refusal only when they are known.
func (l *Lease) logLost(reason LostReason, holder string, err error) {
	attrs := make([]slog.Attr, 0, 7)
	msg := "lease lost"
	switch l.kind {
	case kindMember:
		msg = "membership registration lost"
		attrs = append(attrs, slog.String("worker", l.info.Holder))
	case kindLock:
		msg = "lock lost"
		attrs = append(attrs, slog.String("lock", l.name))
	default:
		attrs = append(attrs, slog.Uint64("partition", uint64(l.info.Partition)))
	}
	attrs = append(attrs, slog.Uint64("epoch", uint64(l.info.Epoch)))
	if l.kind != kindMember {
		attrs = append(attrs, slog.String("worker", l.info.Holder))
	}
	if reason != "" {
		attrs = append(attrs, slog.String("reason", string(reason)))
	}
	if holder != "" {
		attrs = append(attrs, slog.String("holder", holder))
	}
	if err != nil {
		attrs = append(attrs, slog.Any("err", err))
	}
	l.c.cfg.Logger.LogAttrs(context.Background(), slog.LevelWarn, msg, attrs...)
}

// what names what the lease is on, for a log message.
func (l *Lease) what() string {
	if l.kind == kindLock {
		return "lock"
	}
	return "partition"
}

// logReleaseFailed logs a release that did not land, naming what the
// lease was on the way logLost does.
func (l *Lease) logReleaseFailed(err error) {
	attrs := make([]slog.Attr, 0, 4)
	msg := "lease release failed"
	switch l.kind {
	case kindMember:
		msg = "membership registration release failed"
	case kindLock:
		msg = "lock release failed"
		attrs = append(attrs, slog.String("lock", l.name))
	default:
		attrs = append(attrs, slog.Uint64("partition", uint64(l.info.Partition)))
	}
	attrs = append(attrs, slog.Uint64("epoch", uint64(l.info.Epoch)), slog.String("worker", l.info.Holder), slog.Any("err", err))
	l.c.cfg.Logger.LogAttrs(context.Background(), slog.LevelWarn, msg, attrs...)
}
