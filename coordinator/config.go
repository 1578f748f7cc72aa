package coordinator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"
)

// Config configures a Coordinator: one worker's view of the lease bucket.
type Config struct {
	// Worker identifies this worker in lease records, logs and traces. It
	// must be unique among live workers: letters, digits, '-' and '_'.
	// Default: the host name and a random suffix.
	Worker string

	// Partitions is the number of partitions Run balances. Required for Run.
	Partitions int

	// TTL is how long a lease lives on the server after its last renewal.
	// Whole seconds, at least 1s. Default 10s.
	TTL time.Duration
	// RenewEvery is the renewal interval. Default TTL/3.
	RenewEvery time.Duration
	// Margin is subtracted from the TTL for the local deadline, to allow for
	// clock rate differences and scheduling delay. Default TTL/10, and at
	// least 100ms.
	Margin time.Duration
	// RequestTimeout bounds one request to the server. Default RenewEvery/2,
	// capped at 2s.
	RequestTimeout time.Duration
	// Rescan is how often Run re-reads the whole bucket, covering watch
	// events it missed. Default TTL.
	Rescan time.Duration
	// RebalanceDelay is how long membership must stay unchanged before this
	// worker hands partitions off to newcomers, so that workers joining
	// together cause one round of moves rather than one per worker. Taking
	// free partitions is never delayed. Default 250ms.
	RebalanceDelay time.Duration
	// ShutdownTimeout bounds the drain and release when Run's context ends.
	// Default 30s.
	ShutdownTimeout time.Duration

	// RenewPartitions makes every partition lease Run holds renew itself,
	// one write per partition every RenewEvery, as leases taken with
	// Acquire and locks do. By default Run's partition leases live by this
	// worker's member session instead: the registration member.<worker>
	// is the only key the worker renews, so the lease bucket takes about
	// 3/TTL writes a second per worker whatever the partition count, plus
	// one write per acquisition and release, and every worker's watch
	// receives only those. Epochs, fencing and fail-over within the TTL
	// are the same either way; with sessions all of a worker's partitions
	// share one local deadline, and a registration that cannot renew loses
	// them all at once. Workers of either setting share a bucket. Workers
	// of releases before sessions never take over a partition a session
	// holds (see the package documentation).
	RenewPartitions bool

	// OnAcquire is called by Run when it has acquired a partition and fenced
	// its progress. The lease is live; start consuming. It must not block.
	// Releasing the lease gives the partition up: Run may acquire it again
	// later, as the assignment says.
	OnAcquire func(*Lease)
	// OnRevoke is called by Run, in its own goroutine, before it releases a
	// partition that should move to another worker or when Run stops: stop
	// taking work, finish what is in flight and commit progress, then
	// return. ctx ends when the lease is lost or the shutdown timeout
	// passes. The lease is released when OnRevoke returns.
	OnRevoke func(ctx context.Context, l *Lease)

	// Logger receives lease events. Default slog.Default().
	Logger *slog.Logger
	// Observer receives lease events for tracing and metrics. Optional.
	Observer Observer
}

func (c *Config) setDefaults() {
	if c.Worker == "" {
		host, _ := os.Hostname()
		c.Worker = sanitizeWorker(host) + "-" + newToken()[:6]
	}
	if c.TTL == 0 {
		c.TTL = 10 * time.Second
	}
	if c.RenewEvery == 0 {
		c.RenewEvery = c.TTL / 3
	}
	if c.Margin == 0 {
		c.Margin = max(c.TTL/10, 100*time.Millisecond)
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = min(c.RenewEvery/2, 2*time.Second)
	}
	if c.Rescan == 0 {
		c.Rescan = c.TTL
	}
	if c.RebalanceDelay == 0 {
		c.RebalanceDelay = 250 * time.Millisecond
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Observer == nil {
		c.Observer = nopObserver{}
	}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	if !validToken(c.Worker, false) {
		errs = append(errs, fmt.Errorf("worker ID %q: use letters, digits, '-' and '_' only (at most 128)", c.Worker))
	}
	if c.Partitions < 0 || c.Partitions > 1<<16 {
		errs = append(errs, fmt.Errorf("partitions %d: use 1 to 65536", c.Partitions))
	}
	if c.TTL < time.Second || c.TTL%time.Second != 0 {
		errs = append(errs, fmt.Errorf("TTL %v: the server counts lease TTLs in whole seconds, at least 1s", c.TTL))
	}
	if c.RenewEvery <= 0 || c.RenewEvery > c.TTL/2 {
		errs = append(errs, fmt.Errorf("renew interval %v: renew at least twice per TTL (%v), so one lost renewal does not lose the lease", c.RenewEvery, c.TTL))
	}
	if c.Margin < 0 || c.Margin >= c.TTL-c.RenewEvery {
		errs = append(errs, fmt.Errorf("margin %v: keep it below TTL minus the renew interval (%v), or leases lapse locally between renewals", c.Margin, c.TTL-c.RenewEvery))
	}
	if c.RequestTimeout <= 0 || c.RequestTimeout > c.TTL {
		errs = append(errs, fmt.Errorf("request timeout %v: use a positive value below the TTL", c.RequestTimeout))
	}
	if c.Rescan <= 0 {
		errs = append(errs, fmt.Errorf("rescan interval %v must be positive", c.Rescan))
	}
	if c.RebalanceDelay < 0 {
		errs = append(errs, fmt.Errorf("rebalance delay %v must not be negative", c.RebalanceDelay))
	}
	if c.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("shutdown timeout %v must be positive", c.ShutdownTimeout))
	}
	return errors.Join(errs...)
}

func sanitizeWorker(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			b[i] = '-'
		}
	}
	if len(b) == 0 {
		return "worker"
	}
	if len(b) > 100 {
		b = b[:100]
	}
	return string(b)
}
