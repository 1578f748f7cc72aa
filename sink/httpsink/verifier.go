package httpsink

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// Unstamped says what a Verifier does with a request that carries no
// leasehold stamp at all.
type Unstamped int

const (
	// RefuseUnstamped answers 400 (CodeMissingStamp). The default.
	RefuseUnstamped Unstamped = iota
	// PassUnstamped hands the request on unchecked and not deduped: for
	// an endpoint that also serves clients outside leasehold.
	PassUnstamped
)

// VerifierConfig configures a Verifier.
type VerifierConfig struct {
	// Fences keeps the fences: the highest epoch per scope and partition,
	// and per relay scope. Its Advance must judge and raise in one atomic
	// step, as every leasehold sink's does: sink.NewMemory (the default;
	// for tests and single-process receivers), kvsink.New (a fence key
	// per fence, compare-and-set) or pgsink.New (a fence row per fence,
	// one statement). Given a Verifier (the lease bucket), those also
	// refuse epochs the lease bucket never issued. Its refusals are
	// counted and logged as its own (leasehold_sink_effects_total).
	Fences sink.Fencer
	// Keys keeps the idempotency keys. Default NewMemoryKeys(0).
	Keys Keys
	// KeepFor is how long a key's answer is remembered: a repeat within
	// it gets the first answer's status without the handler; after it,
	// the handler runs again. Default 24h.
	KeepFor time.Duration
	// HoldFor bounds how long a request may hold its key while its handler
	// runs: repeats meanwhile get 409 (CodeInProgress); past it, the
	// claim expires and a repeat runs the handler again. Set it above the
	// handler's longest run. Default 1 minute.
	HoldFor time.Duration
	// Unstamped says what to do with a request without a stamp. Default
	// RefuseUnstamped.
	Unstamped Unstamped
	// RequireRelay refuses requests without a relay stamp (400,
	// CodeMissingRelay): for a receiver that takes effects through a
	// relay only.
	RequireRelay bool
	// RelayScopes, when set, are the relay scopes accepted
	// ("<lease bucket scope>/<lock name>"); others get 400.
	RelayScopes []string
	// MaxBodyBytes bounds a request's body (413). Default 1 MiB.
	MaxBodyBytes int64
	// MaxHeaders bounds the request's header fields (431). Default 128.
	MaxHeaders int
	// Logger receives what the store could not do. Default slog.Default().
	Logger *slog.Logger
}

func (c *VerifierConfig) setDefaults() {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Fences == nil {
		c.Fences = sink.NewMemory(sink.MemoryConfig{Name: "http-verifier", Logger: c.Logger})
	}
	if c.Keys == nil {
		c.Keys = NewMemoryKeys(0)
	}
	if c.KeepFor == 0 {
		c.KeepFor = 24 * time.Hour
	}
	if c.HoldFor == 0 {
		c.HoldFor = time.Minute
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = 1 << 20
	}
	if c.MaxHeaders == 0 {
		c.MaxHeaders = 128
	}
}

// Verifier is net/http middleware for receivers you own: it refuses stale
// requests and runs each effect's handler once per idempotency key.
//
// For each request, in order:
//
//  1. Bounds: more than MaxHeaders header fields get 431, a body above
//     MaxBodyBytes 413.
//  2. The stamp, read with the root package's parsers (leasehold.
//     StampFromHeader; a relay's with RelayFromHeader). No stamp at all:
//     400 (or handed on, with PassUnstamped). A malformed one: 400.
//  3. Idempotency-Key: required, one Structured Field String, and it must
//     be IdempotencyKey(stamp) (the key names the effect the stamp does):
//     400 otherwise.
//  4. The fence, in one atomic step of the store that judges and records
//     (Fences.Advance): a relayed request on its relay's fence (the
//     relay's scope, partition 0, its epoch and acquisition), a direct one
//     on its own scope and partition. A request below the recorded epoch
//     gets 409 and a Refusal naming the fence, the request's epoch and
//     the recorded one, its acquisition and holder; an equal epoch of
//     another acquisition the same (CodeSplitBrain); an epoch the lease
//     bucket never issued (stores with verified epochs) 403.
//  5. The key (Keys.Claim, one atomic step): a key already answered gets
//     that answer's status, with Idempotent-Replayed: true and no body,
//     and the handler does not run; one used first with another method or
//     body gets 422; one whose first request is still being handled gets
//     409 (CodeInProgress) with Retry-After: 1, as the IETF draft says, and
//     the relay tries again later. A claimed key runs the handler: its
//     status is remembered for KeepFor, except a 5xx, 408, 409, 425 or 429
//     (and a panic), which release the key so that a retry runs the
//     handler again.
//
// The store not answering gives 503 with Retry-After: 1.
//
// A relayed request is judged on the relay's fence alone. Its effect's
// epoch was judged by the stream sink runner at its place in the effect
// log, where a former holder's effects published before its successor's
// barrier are admitted (their jobs may be committed), and so are its
// dead letters replayed later; the relay sends a batch's requests side by
// side. A receiver that judged those by the partition's highest epoch
// seen would refuse committed effects.
//
// The handler finds the admitted stamp with StampFrom and the relay's
// with RelayFrom.
type Verifier struct {
	cfg VerifierConfig

	passed, replayed, stale, inProgress, reused, bad, unavailable, unstamped atomic.Uint64
}

// NewVerifier returns a Verifier.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	cfg.setDefaults()
	if cfg.KeepFor < 0 || cfg.HoldFor < 0 || cfg.MaxBodyBytes < 0 || cfg.MaxHeaders < 0 {
		return nil, errors.New("httpsink: verifier: durations and bounds must not be negative")
	}
	for _, s := range cfg.RelayScopes {
		if err := leasehold.ValidateScope(s); err != nil {
			return nil, fmt.Errorf("httpsink: verifier: relay scope %q: %w", s, err)
		}
	}
	return &Verifier{cfg: cfg}, nil
}

// VerifierStats counts a Verifier's answers.
type VerifierStats struct {
	Passed      uint64 // handed to the handler
	Replayed    uint64 // answered from the key store
	Stale       uint64 // refused by a fence (stale, split brain, unverified)
	InProgress  uint64 // 409 while the key's first request runs
	KeyReused   uint64 // 422
	Bad         uint64 // 400, 413, 431
	Unavailable uint64 // 503: the store did not answer
	Unstamped   uint64 // handed on unchecked (PassUnstamped)
}

// Stats returns the counts so far.
func (v *Verifier) Stats() VerifierStats {
	return VerifierStats{
		Passed: v.passed.Load(), Replayed: v.replayed.Load(), Stale: v.stale.Load(), InProgress: v.inProgress.Load(),
		KeyReused: v.reused.Load(), Bad: v.bad.Load(), Unavailable: v.unavailable.Load(), Unstamped: v.unstamped.Load(),
	}
}

// Wrap returns next behind the verifier.
func (v *Verifier) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { v.serve(w, r, next) })
}

func (v *Verifier) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	refuse := func(status int, ref Refusal) {
		switch status {
		case http.StatusBadRequest, http.StatusRequestEntityTooLarge, http.StatusRequestHeaderFieldsTooLarge:
			v.bad.Add(1)
		}
		ref.write(w, status)
	}
	fields := 0
	for _, vs := range r.Header {
		fields += len(vs)
	}
	if fields > v.cfg.MaxHeaders {
		refuse(http.StatusRequestHeaderFieldsTooLarge, Refusal{Error: CodeTooManyHeaders, Message: fmt.Sprintf("%d header fields; the limit is %d", fields, v.cfg.MaxHeaders)})
		return
	}
	if !stamped(r.Header) {
		if v.cfg.Unstamped == PassUnstamped {
			v.unstamped.Add(1)
			next.ServeHTTP(w, r)
			return
		}
		refuse(http.StatusBadRequest, Refusal{Error: CodeMissingStamp, Message: "the request carries no leasehold stamp (Leasehold-Scope and the others): send effects through a leasehold relay, or stamp them with httpsink.SetStamp"})
		return
	}
	st, err := leasehold.StampFromHeader(r.Header)
	if err != nil {
		refuse(http.StatusBadRequest, Refusal{Error: CodeBadStamp, Message: err.Error()})
		return
	}
	relay, relayed, err := RelayFromHeader(r.Header)
	switch {
	case err != nil:
		refuse(http.StatusBadRequest, Refusal{Error: CodeBadStamp, Message: err.Error()})
		return
	case !relayed && v.cfg.RequireRelay:
		refuse(http.StatusBadRequest, Refusal{Error: CodeMissingRelay, Message: "this receiver takes effects through a leasehold relay only: the request has no Leasehold-Relay-* stamp"})
		return
	case relayed && len(v.cfg.RelayScopes) > 0 && !slices.Contains(v.cfg.RelayScopes, relay.Scope):
		refuse(http.StatusBadRequest, Refusal{Error: CodeBadStamp, Scope: relay.Scope, Message: fmt.Sprintf("relay scope %q is not one this receiver takes", relay.Scope)})
		return
	}
	key, ok := v.checkKey(r.Header, st)
	if !ok {
		refuse(http.StatusBadRequest, key)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, v.cfg.MaxBodyBytes+1))
	if err != nil {
		refuse(http.StatusBadRequest, Refusal{Error: CodeBadStamp, Message: "reading the body: " + err.Error()})
		return
	}
	if int64(len(body)) > v.cfg.MaxBodyBytes {
		refuse(http.StatusRequestEntityTooLarge, Refusal{Error: CodeTooLarge, Message: fmt.Sprintf("the body is above the limit of %d bytes", v.cfg.MaxBodyBytes)})
		return
	}
	ctx := r.Context()
	fence, lease := FenceEffect, leasehold.Lease{Scope: st.Scope, Partition: st.Partition, Epoch: st.Epoch, Acquisition: st.Acquisition, Holder: st.Worker}
	if relayed {
		fence, lease = FenceRelay, relay
	}
	if err := v.cfg.Fences.Advance(ctx, lease); err != nil {
		var stale *leasehold.StaleEpochError
		switch {
		case errors.As(err, &stale):
			v.stale.Add(1)
			refuse(http.StatusConflict, staleRefusal(fence, stale))
		case errors.Is(err, sink.ErrUnverifiedEpoch):
			v.stale.Add(1)
			refuse(http.StatusForbidden, Refusal{Error: CodeUnverified, Fence: fence, Scope: lease.Scope, Partition: uint32(lease.Partition),
				Epoch: uint64(lease.Epoch), Acquisition: lease.Acquisition, Message: err.Error()})
		case errors.Is(err, leasehold.ErrBadStamp):
			refuse(http.StatusBadRequest, Refusal{Error: CodeBadStamp, Message: err.Error()})
		default:
			v.unavailable.Add(1)
			v.cfg.Logger.Warn("httpsink: the verifier's fence store did not answer", "fence", lease.Fence().String(), "err", err)
			refuse(http.StatusServiceUnavailable, Refusal{Error: CodeUnavailable, Message: "the fence store did not answer; try again"})
		}
		return
	}
	sum := fingerprint(r.Method, body)
	c, err := v.cfg.Keys.Claim(ctx, key.Key, sum, v.cfg.HoldFor)
	if err != nil {
		v.unavailable.Add(1)
		v.cfg.Logger.Warn("httpsink: the verifier's key store did not answer", "key", st.Key, "err", err)
		refuse(http.StatusServiceUnavailable, Refusal{Error: CodeUnavailable, Message: "the key store did not answer; try again"})
		return
	}
	switch {
	case !c.Won && c.Sum != sum:
		v.reused.Add(1)
		refuse(http.StatusUnprocessableEntity, Refusal{Error: CodeKeyReused, Key: st.Key, Scope: st.Scope,
			Message: "this Idempotency-Key was first used with another method or body"})
		return
	case !c.Won && c.Status == 0:
		v.inProgress.Add(1)
		refuse(http.StatusConflict, Refusal{Error: CodeInProgress, Key: st.Key, Scope: st.Scope,
			Message: "a request with this Idempotency-Key is being handled; try again"})
		return
	case !c.Won:
		v.replayed.Add(1)
		w.Header().Set(HeaderReplayed, "true")
		w.Header().Set("Content-Length", "0")
		w.WriteHeader(c.Status)
		return
	}
	v.passed.Add(1)
	r.Body = io.NopCloser(bytes.NewReader(body))
	ctx = context.WithValue(ctx, stampKey, st)
	if relayed {
		ctx = context.WithValue(ctx, relayKey, relay)
	}
	rec := &recorder{ResponseWriter: w}
	done := false
	defer func() {
		if done {
			return
		}
		// A panic: the key is given up, so a retry runs the handler again.
		if err := v.cfg.Keys.Release(context.WithoutCancel(ctx), c); err != nil {
			v.cfg.Logger.Warn("httpsink: releasing an idempotency key after a panic failed", "key", st.Key, "err", err)
		}
	}()
	next.ServeHTTP(rec, r.WithContext(ctx))
	done = true
	status := rec.status
	if status == 0 {
		status = http.StatusOK
	}
	sctx := context.WithoutCancel(ctx)
	if remembered(status) {
		err = v.cfg.Keys.Done(sctx, c, status, v.cfg.KeepFor)
	} else {
		err = v.cfg.Keys.Release(sctx, c)
	}
	if err != nil {
		v.cfg.Logger.Warn("httpsink: recording an idempotency key failed: a repeat may run the handler again (raise HoldFor above the handler's longest run)",
			"key", st.Key, "status", status, "err", err)
	}
}

// stamped reports whether h carries any of the stamp's headers, in either
// form.
func stamped(h http.Header) bool { return leasehold.HasStamp(h) }

// checkKey reads the Idempotency-Key and checks it names st's effect. It
// returns the key's text, or the refusal.
func (v *Verifier) checkKey(h http.Header, st leasehold.Stamp) (Refusal, bool) {
	raw, n, err := one(h, HeaderIdempotencyKey)
	switch {
	case err != nil:
		return Refusal{Error: CodeBadKey, Message: err.Error()}, false
	case n == 0:
		return Refusal{Error: CodeMissingKey, Message: "the request has no Idempotency-Key"}, false
	}
	k, err := ParseIdempotencyKey(raw)
	if err != nil {
		return Refusal{Error: CodeBadKey, Message: err.Error()}, false
	}
	if want := keyText(st.Scope, st.Key); k != want {
		return Refusal{Error: CodeBadKey, Scope: st.Scope, Key: st.Key,
			Message: "the Idempotency-Key names another effect than the stamp: it must be the stamp's scope, a space and its key (httpsink.IdempotencyKey)"}, false
	}
	return Refusal{Key: k}, true
}

// fingerprint hashes what must not change between repeats of one key.
func fingerprint(method string, body []byte) [32]byte {
	h := sha256.New()
	h.Write([]byte(method))
	h.Write([]byte{0})
	h.Write([]byte(strconv.Itoa(len(body))))
	h.Write([]byte{0})
	h.Write(body)
	var s [32]byte
	h.Sum(s[:0])
	return s
}

// remembered reports whether a handler's status is kept for repeats:
// statuses that say "try again" are not.
func remembered(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status < 500
}

// recorder notes the status a handler writes.
type recorder struct {
	http.ResponseWriter
	status int
}

func (r *recorder) WriteHeader(code int) {
	if r.status == 0 && code >= 200 {
		r.status = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the writer underneath.
func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }
