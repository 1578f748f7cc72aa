package httpsink

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/telemetry"
)

// Deliver sends one effect: a stream sink runner's Handler. It waits
// until the relay holds its lock, sends the request stamped with the
// effect's stamp and the lock's, and returns nil once the receiver
// answered 2xx. Its errors are *DeliveryError (see there for which are
// permanent), or ctx's. A receiver's answer that a newer relay's epoch is
// recorded ends the relay's term (ErrRelaySuperseded): Deliver then waits
// for the lock again and sends anew under the new epoch, unless ctx
// (under RunSink, the term's) ends first. An endpoint whose receiver
// refused maxStaleTerms terms in a row, while another endpoint took a
// request under one of those epochs or a later one, is fenced out: its
// refusals end no term, they fail the effect for good (the dead-letter
// stream), and the endpoint is down (Ready, Config.OnEndpoint, the
// endpoint gauge) until its receiver takes a request again.
func (r *Relay) Deliver(ctx context.Context, e sink.Effect) error {
	if r.wasAcked(e.Stamp) {
		return nil
	}
	return r.deliver(ctx, e)
}

// DeliverBatch sends a batch's effects: a stream sink runner's
// BatchHandler. A job's effects come in one call, and their requests are
// sent together: effects of one fence and subject one after another in
// log order, others side by side (Config.Concurrency). It returns nil when
// every request was answered 2xx. Otherwise it returns the first error
// once the requests in flight are answered, and sends no request after
// the one that failed on its chain; the runner then hands the effects
// over one per call, and those a receiver already took are not sent
// again.
func (r *Relay) DeliverBatch(ctx context.Context, effects []sink.Effect) error {
	if len(effects) == 1 {
		return r.Deliver(ctx, effects[0])
	}
	todo := effects[:0:0]
	for _, e := range effects {
		if !r.wasAcked(e.Stamp) {
			todo = append(todo, e)
		}
	}
	effects = todo
	// Requests that can never be sent fail the call before any is: the
	// runner then finds the one and dead-letters it alone.
	for i := range effects {
		if _, err := r.route(effects[i]); err != nil {
			return err
		}
		if len(effects[i].Data) > r.cfg.MaxBodyBytes {
			return r.tooLarge(effects[i])
		}
	}
	chains := map[chainKey][]int{}
	var order []chainKey
	for i, e := range effects {
		k := chainKey{fence: e.Stamp.Fence(), subject: e.Subject}
		if _, ok := chains[k]; !ok {
			order = append(order, k)
		}
		chains[k] = append(chains[k], i)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
		acked []leasehold.Stamp
	)
	sem := make(chan struct{}, r.cfg.Concurrency)
	failed := func() bool { mu.Lock(); defer mu.Unlock(); return first != nil }
	for _, k := range order {
		idx := chains[k]
		// A chain holds one slot at a time: its requests go in order.
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return ctx.Err()
		}
		if failed() {
			<-sem
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			for _, i := range idx {
				if failed() {
					return
				}
				err := r.deliver(ctx, effects[i])
				mu.Lock()
				if err == nil {
					acked = append(acked, effects[i].Stamp)
				} else if first == nil {
					first = err
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	if first != nil && len(acked) > 0 {
		r.ack(acked)
	}
	return first
}

type chainKey struct {
	fence   leasehold.FenceID
	subject string
}

// deliver sends e under the relay's current lock until it is answered, or
// its term is superseded and it has sent it again under the next.
func (r *Relay) deliver(ctx context.Context, e sink.Effect) error {
	for {
		l, err := r.holding(ctx)
		if err != nil {
			return err
		}
		relay := l.Info()
		err = r.send(ctx, e, relay)
		var sup *superseded
		if !errors.As(err, &sup) {
			if err == nil {
				r.delivered()
			}
			return err
		}
		r.supersede(relay, sup.ref)
	}
}

// superseded is send's error when the receiver recorded a newer relay
// epoch.
type superseded struct{ ref Refusal }

func (s *superseded) Error() string { return "httpsink: superseded: " + s.ref.String() }

// NewRequest builds the request that delivers e under relay lease relay,
// as Deliver sends it: to the endpoint configuration picks for e, with
// e's data as the body, the configured headers, e's stamp, its
// Idempotency-Key and the relay's stamp. It adds no trace context.
func (r *Relay) NewRequest(ctx context.Context, e sink.Effect, relay leasehold.Lease) (*http.Request, error) {
	ep, err := r.route(e)
	if err != nil {
		return nil, err
	}
	if len(e.Data) > r.cfg.MaxBodyBytes {
		return nil, r.tooLarge(e)
	}
	if err := e.Stamp.Validate(); err != nil {
		return nil, r.permanent(ep, "the effect's stamp is invalid: "+err.Error())
	}
	req, err := http.NewRequestWithContext(ctx, r.cfg.Method, ep.url.String(), bytes.NewReader(e.Data))
	if err != nil {
		return nil, r.permanent(ep, "build the request: "+err.Error())
	}
	h := req.Header
	for k, vs := range r.cfg.Header {
		h[k] = vs
	}
	h.Set("Content-Type", r.cfg.ContentType)
	h.Set("User-Agent", "leasehold-relay")
	e.Stamp.SetHeader(h)
	h.Set(HeaderIdempotencyKey, IdempotencyKey(e.Stamp))
	SetRelayHeader(h, relay)
	if printable(e.Subject, 256) {
		h.Set(HeaderSubject, e.Subject)
	}
	return req, nil
}

// route picks e's endpoint from configuration alone: RouteHeader's value
// naming a configured endpoint, the first route whose subject pattern
// matches, or URL's. Nothing in e is ever used as an address.
func (r *Relay) route(e sink.Effect) (*endpoint, error) {
	if r.cfg.RouteHeader != "" {
		if v := headerValue(e.Header, r.cfg.RouteHeader); v != "" {
			if ep, ok := r.eps[v]; ok {
				return ep, nil
			}
			name := v
			if !validName(name) {
				name = fmt.Sprintf("%q (not an endpoint name)", excerpt([]byte(v), 64))
			}
			return nil, &DeliveryError{Endpoint: name, Origin: "none", Method: r.cfg.Method, Permanent: true,
				Err: fmt.Sprintf("the effect's %s names no configured endpoint: effects pick among the endpoints the relay is configured with (%v), and never name a host", r.cfg.RouteHeader, sortedNames(r.eps))}
		}
	}
	for _, rt := range r.cfg.Routes {
		if matchSubject(rt.Subject, e.Subject) {
			return r.eps[rt.Endpoint], nil
		}
	}
	if ep, ok := r.eps[DefaultEndpoint]; ok {
		return ep, nil
	}
	return nil, &DeliveryError{Endpoint: "none", Origin: "none", Method: r.cfg.Method, Permanent: true,
		Err: fmt.Sprintf("no route takes subject %q and no URL is configured", excerpt([]byte(e.Subject), 128))}
}

func (r *Relay) tooLarge(e sink.Effect) error {
	ep, _ := r.route(e)
	de := &DeliveryError{Method: r.cfg.Method, Permanent: true,
		Err: fmt.Sprintf("the effect's data is %d bytes, above the relay's limit of %d (Config.MaxBodyBytes)", len(e.Data), r.cfg.MaxBodyBytes)}
	if ep != nil {
		de.Endpoint, de.Origin = ep.name, ep.origin
	}
	return de
}

func (r *Relay) permanent(ep *endpoint, why string) error {
	return &DeliveryError{Endpoint: ep.name, Origin: ep.origin, Method: r.cfg.Method, Permanent: true, Err: why}
}

// send makes one request for e under relay lease relay and classifies
// the answer.
func (r *Relay) send(ctx context.Context, e sink.Effect, relay leasehold.Lease) error {
	req, err := r.NewRequest(ctx, e, relay)
	if err != nil {
		return err
	}
	ep, _ := r.route(e)
	if err := ep.health.wait(ctx); err != nil {
		return err
	}
	// The span: under the decision's (Handler) or, in a batch, the
	// worker's span that published the effect.
	parent := ctx
	if !trace.SpanContextFromContext(ctx).IsValid() {
		parent = r.prop.Extract(ctx, telemetry.HeaderCarrier(e.Header))
	}
	sctx, span := r.tracer.Start(parent, r.cfg.Method, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(append(telemetry.StampAttrs(e.Stamp),
			attribute.String("http.request.method", r.cfg.Method),
			attribute.String("server.address", ep.url.Hostname()),
			attribute.String("url.scheme", ep.url.Scheme),
			telemetry.AttrSink.String(r.cfg.Name),
			attribute.String("leasehold.endpoint", ep.name),
			attribute.Int64("leasehold.relay_epoch", int64(relay.Epoch)),
		)...))
	defer span.End()
	r.prop.Inject(sctx, propagation.HeaderCarrier(req.Header))
	req = req.WithContext(sctx)
	resp, err := r.client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			span.SetStatus(codes.Error, "cancelled")
			return ctx.Err()
		}
		de := transportError(err)
		de.Endpoint, de.Origin, de.Method = ep.name, ep.origin, r.cfg.Method
		if de.Permanent {
			r.answered(ep)
			r.counted(ctx, ep, "permanent")
			span.SetStatus(codes.Error, de.Error())
			return de
		}
		return r.failure(ctx, span, ep, e, de)
	}
	defer func() {
		// Read a little more so that the connection can be used again;
		// a receiver that sends more loses it.
		_, _ = io.CopyN(io.Discard, resp.Body, 64<<10)
		resp.Body.Close()
	}()
	span.SetAttributes(attribute.Int("http.response.status_code", resp.StatusCode))
	body, _ := io.ReadAll(io.LimitReader(resp.Body, maxRefusal))
	code := resp.StatusCode
	if code >= 200 && code < 300 {
		ep.health.took(relay.Epoch)
		if r.answered(ep) {
			r.log.Info("httpsink: the receiver answers again", "endpoint", ep.name, "origin", ep.origin)
		}
		r.counted(ctx, ep, "delivered")
		return nil
	}
	de := &DeliveryError{Endpoint: ep.name, Origin: ep.origin, Method: r.cfg.Method, Status: code, Body: excerpt(body, maxExcerpt)}
	switch {
	case code == http.StatusConflict:
		r.answered(ep)
		ref, ok := parseRefusal(body)
		switch {
		case ok && ref.supersedes(relay):
			span.SetAttributes(attribute.String("error.type", telemetry.ErrorTypeStaleEpoch),
				attribute.Int64(string(telemetry.AttrMaxEpoch), int64(ref.Max)))
			if why, fenced := r.fencedOut(ep, relay, ref); fenced {
				// This receiver alone refuses every term: it holds
				// the effect, not the relay.
				de.Err, de.Permanent = why, true
				r.counted(ctx, ep, "permanent")
				span.SetStatus(codes.Error, de.Error())
				return de
			}
			span.SetStatus(codes.Error, "superseded")
			r.counted(ctx, ep, "superseded")
			return &superseded{ref: ref}
		case ok && ref.Error == CodeInProgress:
			// The first request with this key is still being handled:
			// its answer comes on a later try.
			de.Err, de.RetryAfter = "a request with the same Idempotency-Key is in progress at the receiver", time.Second
			r.counted(ctx, ep, "in_progress")
			span.SetStatus(codes.Error, "in progress")
			return r.waitRetry(ctx, de)
		}
		// Any other conflict is retried within MaxDeliveries, as the
		// Idempotency-Key draft answers a key in use: a receiver of
		// Stripe's kind says so with a plain 409.
		if ok {
			de.Err = "the receiver's verifier refused the effect: " + ref.String()
		}
		de.RetryAfter = min(parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()), r.cfg.MaxRetryAfter)
		r.counted(ctx, ep, "retry")
		span.SetStatus(codes.Error, de.Error())
		if de.RetryAfter > 0 {
			return r.waitRetry(ctx, de)
		}
		return de
	case code == http.StatusTooManyRequests:
		r.answered(ep)
		de.RetryAfter = min(max(parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()), time.Second), r.cfg.MaxRetryAfter)
		ep.health.backOff(de.RetryAfter)
		r.counted(ctx, ep, "retry")
		span.SetStatus(codes.Error, de.Error())
		return r.waitRetry(ctx, de)
	case code == http.StatusRequestTimeout:
		r.answered(ep)
	case code >= 500:
		if ra := parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()); ra > 0 && code == http.StatusServiceUnavailable {
			de.RetryAfter = min(ra, r.cfg.MaxRetryAfter)
			ep.health.backOff(de.RetryAfter)
		}
		return r.failure(ctx, span, ep, e, de)
	default: // 1xx left over, 3xx, other 4xx
		r.answered(ep)
		de.Permanent = true
		switch {
		case code >= 300 && code < 400 && r.cfg.MaxRedirects > 0 && redirectDrops(code):
			de.Err = "a redirect that would resend the effect as a GET without its body, which the relay never follows (it follows 307 and 308 only): configure the endpoint's final URL"
		case code >= 300 && code < 400:
			de.Err = "a redirect, which the relay does not follow (Config.MaxRedirects: 307 and 308 only)"
		}
	}
	outcome := "retry"
	if de.Permanent {
		outcome = "permanent"
	}
	r.counted(ctx, ep, outcome)
	span.SetStatus(codes.Error, de.Error())
	return de
}

// failure records a request that got no answer, or a 5xx: the receiver
// looks down.
func (r *Relay) failure(ctx context.Context, span trace.Span, ep *endpoint, e sink.Effect, de *DeliveryError) error {
	if ep.health.failed(de.Error()) {
		r.log.Warn("httpsink: the receiver does not take requests; the runner retries with backoff and /readyz fails until it does",
			"endpoint", ep.name, "origin", ep.origin, "key", e.Stamp.Key, "err", de.Error())
	}
	r.report(ep)
	r.counted(ctx, ep, "retry")
	span.SetStatus(codes.Error, de.Error())
	return de
}

// waitRetry waits what de asks before the runner's next try, within ctx.
func (r *Relay) waitRetry(ctx context.Context, de *DeliveryError) error {
	if err := sleep(ctx, de.RetryAfter); err != nil {
		return err
	}
	return de
}

func (r *Relay) counted(ctx context.Context, ep *endpoint, outcome string) {
	r.count.Add(ctx, 1, metric.WithAttributes(telemetry.AttrSink.String(r.cfg.Name),
		attribute.String("leasehold.endpoint", ep.name), telemetry.AttrOutcome.String(outcome)))
}

// transportError describes a request that got no response without the
// URL the client's error names (its path or query may be a credential),
// and without wrapping the cause: the runner must count a timeout toward
// MaxDeliveries like any failure of the destination, not take it for
// NATS's.
func transportError(err error) *DeliveryError {
	de := &DeliveryError{}
	var ue *url.Error
	msg := err.Error()
	if errors.As(err, &ue) {
		msg = ue.Err.Error()
	}
	de.Err = excerpt([]byte(msg), 256)
	if errors.Is(err, errRedirect) {
		de.Permanent = true
	}
	return de
}

// wasAcked reports, and forgets, an effect a receiver took in a batch
// call that failed.
func (r *Relay) wasAcked(s leasehold.Stamp) bool {
	r.ackMu.Lock()
	defer r.ackMu.Unlock()
	k := s.Scope + " " + s.Key
	_, ok := r.acked[k]
	delete(r.acked, k)
	return ok
}

func (r *Relay) ack(stamps []leasehold.Stamp) {
	r.ackMu.Lock()
	defer r.ackMu.Unlock()
	if len(r.acked)+len(stamps) > maxAcked {
		clear(r.acked)
	}
	for _, s := range stamps {
		r.acked[s.Scope+" "+s.Key] = struct{}{}
	}
}

// headerValue returns the first value of header name in h, matched
// without regard to case.
func headerValue(h map[string][]string, name string) string {
	if vs := h[name]; len(vs) > 0 {
		return vs[0]
	}
	for k, vs := range h {
		if len(vs) > 0 && len(k) == len(name) && equalFold(k, name) {
			return vs[0]
		}
	}
	return ""
}

func equalFold(a, b string) bool { return bytes.EqualFold([]byte(a), []byte(b)) }

func sortedNames(m map[string]*endpoint) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
