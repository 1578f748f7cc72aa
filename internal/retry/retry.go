// Package retry retries a request to NATS while the server's answer says it
// cannot serve it yet, and for no longer than a bound.
//
// Some answers go away on their own: a stream created right after one of
// the same name was deleted can fail with API error 10049 ("error creating
// store for stream") while the old store is still being removed; after a
// restart or a node loss the JetStream API answers "JetStream system
// temporarily unavailable" (10008) or "cannot handle request" (10009) until
// a leader is elected, and "no responders" while the server is still
// starting; a request lost in a reconnect times out. Transient says which
// errors are of that kind, and Do retries them with a backoff that doubles
// up to a cap, for at most Policy.For; past it, it returns a *GaveUpError
// that says so and wraps the last error. Any other error ends Do at once,
// as it is.
package retry

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Server answers that a later attempt can get past.
const (
	codeClusterIncomplete  = 10004 // "incomplete results"
	codeNoSuitablePeers    = 10005 // placement while a node is down
	codeClusterNotAvail    = 10008 // "JetStream system temporarily unavailable"
	codeClusterNotLeader   = 10009 // "JetStream cluster can not handle request"
	codeStreamCreate       = 10049 // "error creating store for stream", after a fast delete
	codeStreamOffline      = 10118
	codeConsumerOffline    = 10119
	codeLastSeqNotReady    = 10163 // "expected last sequence per subject temporarily unavailable"
	codeStreamOfflineWhy   = 10194
	codeConsumerOfflineWhy = 10195
)

// Transient reports whether err is an answer or a connection state that a
// later attempt can get past: one of the server's transient API errors, no
// responders (the server is starting, or JetStream is not ready), a
// request timeout, or a connection that is reconnecting.
func Transient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	// jetstream reports no responders on its account API as
	// ErrJetStreamNotEnabled: a server that is still starting.
	if errors.Is(err, jetstream.ErrJetStreamNotEnabled) {
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case codeClusterIncomplete, codeNoSuitablePeers, codeClusterNotAvail, codeClusterNotLeader, codeStreamCreate,
			codeStreamOffline, codeConsumerOffline, codeLastSeqNotReady, codeStreamOfflineWhy, codeConsumerOfflineWhy:
			return true
		}
		return false
	}
	return errors.Is(err, nats.ErrNoResponders) || errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrDisconnected) || errors.Is(err, nats.ErrConnectionReconnecting)
}

// Policy bounds a retry. Zero fields take the defaults.
type Policy struct {
	// For bounds the retrying: no attempt starts after it has passed since
	// the first. Default 30s, long enough for a cluster to elect leaders
	// after a restart.
	For time.Duration
	// Attempt bounds one attempt, within the caller's own deadline: a
	// request lost in a reconnect must not use up the whole budget.
	// Default 5s.
	Attempt time.Duration
	// First is the wait after the first failure; it doubles after each
	// one, up to Max. Defaults 50ms and 1s.
	First, Max time.Duration
	// OnRetry, when set, is told of each transient failure before the
	// wait that follows it.
	OnRetry func(attempt int, err error, wait time.Duration)
}

// Default is the policy Do uses.
var Default = Policy{}

func (p Policy) withDefaults() Policy {
	if p.For <= 0 {
		p.For = 30 * time.Second
	}
	if p.Attempt <= 0 {
		p.Attempt = 5 * time.Second
	}
	if p.First <= 0 {
		p.First = 50 * time.Millisecond
	}
	if p.Max <= 0 {
		p.Max = time.Second
	}
	return p
}

// GaveUpError is the error of a retry that reached its bound.
type GaveUpError struct {
	Attempts int
	Elapsed  time.Duration
	Err      error // the last attempt's
}

func (e *GaveUpError) Error() string {
	return fmt.Sprintf("the server kept giving transient answers for %v (%d attempts), the last: %v; check that the NATS server, or a majority of the cluster, is up",
		e.Elapsed.Round(time.Millisecond), e.Attempts, e.Err)
}

// Unwrap returns the last attempt's error.
func (e *GaveUpError) Unwrap() error { return e.Err }

// Do runs f with the Default policy.
func Do(ctx context.Context, f func(ctx context.Context) error) error { return Default.Do(ctx, f) }

// Value runs f with the Default policy and returns its value.
func Value[T any](ctx context.Context, f func(ctx context.Context) (T, error)) (T, error) {
	var v T
	err := Default.Do(ctx, func(ctx context.Context) error {
		var err error
		v, err = f(ctx)
		return err
	})
	return v, err
}

// Do runs f until it succeeds, fails with an error that is not transient
// (returned as it is), ctx ends, or p's bound passes (a *GaveUpError).
func (p Policy) Do(ctx context.Context, f func(ctx context.Context) error) error {
	p = p.withDefaults()
	start := time.Now()
	wait := p.First
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, p.Attempt)
		err := f(actx)
		cancel()
		if err == nil || !Transient(err) {
			return err
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%w (the last attempt: %w)", ctx.Err(), err)
		}
		if elapsed := time.Since(start); elapsed+wait > p.For {
			return &GaveUpError{Attempts: attempt, Elapsed: elapsed, Err: err}
		}
		if p.OnRetry != nil {
			p.OnRetry(attempt, err, wait)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w (the last attempt: %w)", ctx.Err(), err)
		case <-t.C:
		}
		wait = min(2*wait, p.Max)
	}
}
