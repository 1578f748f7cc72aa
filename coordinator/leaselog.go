package coordinator

import (
	"context"
	"log/slog"
)

// Log lines of a lease's life. They carry only the fields that have a
// value, and name a membership registration as such: it is no partition.

// logAcquired logs an acquisition: at INFO for a partition or a lock, with
// the holder it was taken over from and that holder's epoch when the fence
// record names one.
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
		msg = "took over " + l.what()
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
