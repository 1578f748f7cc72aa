package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// An effect subject that no stream stores answers every publish with "no
// responders", and so does every subject for a few seconds while NATS
// restarts, or a stream whose servers are down. The answer alone does not
// tell the two apart, so such a failure uses no attempt for
// Config.TransientFor. Past it, the worker asks JetStream which stream
// stores the subject:
//
//   - none: the subject's breaker opens, and the failure counts. While it
//     is open every publish on the subject is refused at once with a
//     *NoStreamError, which counts as a failed attempt: the jobs that
//     publish there go through their attempts at their backoff and are
//     dead-lettered, none of them waiting TransientFor again.
//   - a stream does, but did not answer (it has no leader, its server is
//     down), or NATS or JetStream does not answer the question: an
//     outage. The failure uses no attempt; the partition waits, and the
//     stall report (Config.StallAfter) shows it.
//
// Other failures of the transport (a timeout while the stream answers)
// count once TransientFor has passed, as they always did.
//
// An open breaker closes when JetStream names a stream for the subject
// (looked up every breakerProbe while it is open) or when a publish on it
// is stored: one publish per breakerProbe is let through to find out. A
// breaker no publish has asked about for breakerIdle is forgotten. Handlers
// choose subjects, so the breakers are bounded (maxBreakers): a subject
// found without a stream when the bound is reached gets none, and its jobs
// are dead-lettered as before, each after TransientFor.

const (
	// maxBreakers bounds the effect subjects a worker keeps open breakers
	// for.
	maxBreakers = 1024
	// breakerProbe is how often an open breaker's subject is looked up,
	// and a publish on it let through.
	breakerProbe = 2 * time.Second
	// breakerIdle is how long an open breaker no publish asked about is
	// kept (and fails Ready).
	breakerIdle = 5 * time.Minute
	// maxProbes bounds the look-ups of one probe round.
	maxProbes = 16
	// lookupTimeout bounds one look-up of a subject's stream.
	lookupTimeout = 5 * time.Second
)

// ErrNoStream is matched by the error of an effect refused at once because
// no stream stores its subject (see NoStreamError).
var ErrNoStream = errors.New("worker: no stream stores the effect's subject")

// NoStreamError refuses an effect whose subject JetStream said no stream
// stores, after its publishes got no responders for Config.TransientFor.
type NoStreamError struct {
	Subject string
	Since   time.Time // when the subject was found without a stream
}

func (e *NoStreamError) Error() string {
	return fmt.Sprintf("no stream stores subject %s: its publishes got no responders, and JetStream names no stream for it (for %v now); "+
		"jobs publishing there fail at once until one does: add the subject to a stream's subjects "+
		"(leasehold init provisions the job stream's default output, <prefix>.out.<partition>; for a subject of your own, "+
		"create a stream for it or add it to one with nats stream edit), or publish elsewhere",
		e.Subject, time.Since(e.Since).Round(time.Second))
}

// Is makes a NoStreamError match ErrNoStream.
func (e *NoStreamError) Is(target error) bool { return target == ErrNoStream }

// breakers are a worker's open subject breakers. The zero value is ready.
type breakers struct {
	n    atomic.Int32 // len(open), read without the lock on every publish and ack
	mu   sync.Mutex
	open map[string]*breaker
	full time.Time // when the bound last kept one from opening, for the log
}

type breaker struct {
	since   time.Time // opened
	checked time.Time // last looked up
	probed  time.Time // last publish let through
	used    time.Time // last publish that asked
	refused uint64    // publishes refused
}

// breakerState is what JetStream answered about an effect subject.
type breakerState int

const (
	noAnswer breakerState = iota // NATS or JetStream did not answer
	stored                       // a stream stores the subject
	noStream                     // JetStream answered: no stream does
)

// lookupSubject asks JetStream which stream stores subject.
func (w *Worker) lookupSubject(ctx context.Context, subject string) (breakerState, string, error) {
	if st := w.cfg.JetStream.Conn().Status(); st != nats.CONNECTED {
		return noAnswer, "", fmt.Errorf("NATS is %s", st)
	}
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	name, err := w.cfg.JetStream.StreamNameBySubject(ctx, subject)
	switch {
	case err == nil:
		return stored, name, nil
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return noStream, "", nil
	}
	return noAnswer, "", err
}

// refuseNoStream returns the error an effect on subject fails with at
// once, or nil. One publish per breakerProbe is let through.
func (w *Worker) refuseNoStream(subject string) error {
	b := &w.subjects
	if b.n.Load() == 0 {
		return nil
	}
	now := time.Now()
	b.mu.Lock()
	br := b.open[subject]
	if br == nil {
		b.mu.Unlock()
		return nil
	}
	br.used = now
	if now.Sub(br.probed) >= breakerProbe {
		br.probed = now
		b.mu.Unlock()
		w.log.Debug("a publish on an effect subject without a stream is let through, to see whether one stores it now", "subject", subject)
		return nil
	}
	br.refused++
	since := br.since
	b.mu.Unlock()
	w.tel.Metrics.EffectsNoStream.Add(context.Background(), 1)
	return &NoStreamError{Subject: subject, Since: since}
}

// noStreamOpen reports whether subject's breaker is open.
func (w *Worker) noStreamOpen(subject string) bool {
	b := &w.subjects
	if b.n.Load() == 0 {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.open[subject] != nil
}

// openBreaker opens subject's breaker, unless the bound is reached.
func (w *Worker) openBreaker(subject string, cause error) {
	b := &w.subjects
	now := time.Now()
	b.mu.Lock()
	if b.open[subject] != nil {
		b.mu.Unlock()
		return
	}
	if len(b.open) >= maxBreakers {
		warn := now.Sub(b.full) >= time.Minute
		if warn {
			b.full = now
		}
		b.mu.Unlock()
		if warn {
			w.log.Warn("no stream stores an effect subject, and the worker keeps no more subject breakers: its jobs are dead-lettered each after TransientFor",
				"subject", subject, "breakers", maxBreakers)
		}
		return
	}
	if b.open == nil {
		b.open = map[string]*breaker{}
	}
	b.open[subject] = &breaker{since: now, checked: now, probed: now, used: now}
	b.n.Store(int32(len(b.open)))
	n := len(b.open)
	b.mu.Unlock()
	w.tel.Metrics.SetSubjectsUnavailable(w.ID(), n)
	w.log.Error("no stream stores an effect subject: jobs publishing there now fail at once and are dead-lettered after their attempts; add the subject to a stream's subjects (leasehold init provisions <prefix>.out.*)",
		"subject", subject, "transient_for", w.cfg.TransientFor, "cause", cause)
}

// closeBreaker closes subject's breaker, if open.
func (w *Worker) closeBreaker(subject, why string) {
	b := &w.subjects
	b.mu.Lock()
	br := b.open[subject]
	if br == nil {
		b.mu.Unlock()
		return
	}
	delete(b.open, subject)
	b.n.Store(int32(len(b.open)))
	n := len(b.open)
	b.mu.Unlock()
	w.tel.Metrics.SetSubjectsUnavailable(w.ID(), n)
	w.log.Info("effect subject breaker closed: "+why, "subject", subject, "refused", br.refused, "open_for", time.Since(br.since).Round(time.Second))
}

// effectStored closes subject's breaker: a publish there was stored.
func (w *Worker) effectStored(subject string) {
	if w.subjects.n.Load() == 0 {
		return
	}
	w.closeBreaker(subject, "an effect published there was stored")
}

// probeBreakers looks up the subjects of open breakers not looked up for
// breakerProbe, a few a round, and closes those a stream now stores; it
// forgets the breakers no publish asked about for breakerIdle.
func (w *Worker) probeBreakers(ctx context.Context) {
	b := &w.subjects
	if b.n.Load() == 0 {
		return
	}
	now := time.Now()
	type due struct {
		subject string
		checked time.Time
	}
	var todo []due
	var idle []string
	b.mu.Lock()
	for s, br := range b.open {
		switch {
		case now.Sub(br.used) >= breakerIdle:
			idle = append(idle, s)
		case now.Sub(br.checked) >= breakerProbe:
			todo = append(todo, due{s, br.checked})
		}
	}
	b.mu.Unlock()
	for _, s := range idle {
		w.closeBreaker(s, fmt.Sprintf("no publish asked about the subject for %v", breakerIdle))
	}
	slices.SortFunc(todo, func(a, b due) int { return a.checked.Compare(b.checked) })
	for _, d := range todo[:min(len(todo), maxProbes)] {
		st, stream, err := w.lookupSubject(ctx, d.subject)
		if ctx.Err() != nil {
			return
		}
		b.mu.Lock()
		if br := b.open[d.subject]; br != nil {
			br.checked = time.Now()
		}
		b.mu.Unlock()
		switch st {
		case stored:
			w.closeBreaker(d.subject, "stream "+stream+" stores the subject now")
		case noAnswer:
			w.log.Debug("looking up the stream of an effect subject failed", "subject", d.subject, "err", err)
		}
	}
}

// unavailable describes the open breakers for Ready, at most max of them,
// and how many there are.
func (w *Worker) unavailable(max int) ([]string, int) {
	b := &w.subjects
	if b.n.Load() == 0 {
		return nil, 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	subjects := make([]string, 0, len(b.open))
	for s := range b.open {
		subjects = append(subjects, s)
	}
	slices.Sort(subjects)
	out := make([]string, 0, min(len(subjects), max))
	for _, s := range subjects[:min(len(subjects), max)] {
		br := b.open[s]
		out = append(out, fmt.Sprintf("%s (for %v, %d effects refused)", s, time.Since(br.since).Round(time.Second), br.refused))
	}
	return out, len(subjects)
}

// checkEffect refuses msg at once when no stream stores its subject (an
// open breaker), or when a sink could not store it (checkSize).
func (r *runner) checkEffect(msg *nats.Msg, room int) error {
	if err := r.w.refuseNoStream(msg.Subject); err != nil {
		return err
	}
	return r.checkSize(msg, room)
}

// counts reports whether the failure err of the job whose retry state is
// st uses up an attempt (see the comment at the top of this file).
func (r *runner) counts(st *retryState, err error) bool {
	if !effectTransient(err) {
		return true
	}
	var ee *EffectError
	errors.As(err, &ee)
	if r.w.noStreamOpen(ee.Subject) {
		return true
	}
	now := time.Now()
	if st.transientSince.IsZero() {
		st.transientSince = now
	}
	if now.Sub(st.transientSince) < r.w.cfg.TransientFor {
		return false
	}
	state, stream, lerr := r.w.lookupSubject(r.ctx, ee.Subject)
	switch state {
	case noStream:
		r.w.openBreaker(ee.Subject, ee.Err)
		return true
	case stored:
		if noResponders(ee.Err) {
			r.log.Warn("a stream stores the effect subject but did not answer (no leader, or its server is down): the attempt is not counted",
				"subject", ee.Subject, "stream", stream, "failing_for", now.Sub(st.transientSince).Round(time.Millisecond))
			return false
		}
		return true
	}
	r.log.Warn("an effect failed and JetStream does not answer: NATS is down or restarting; the attempt is not counted",
		"subject", ee.Subject, "failing_for", now.Sub(st.transientSince).Round(time.Millisecond), "err", lerr)
	return false
}

// noResponders reports whether a publish found nobody to store it.
func noResponders(err error) bool {
	return errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse)
}
