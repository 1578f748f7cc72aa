package worker

import (
	"context"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// A job's effects published through Job.Publish and Job.Emit apply all or
// none. Each carries the job and the attempt (leasehold.HeaderJob,
// leasehold.HeaderAttempt); the attempt number rises with every attempt
// the runner makes under its lease, a rewind's re-run included. The latest
// effect on each subject is held back until the handler returns: when it
// succeeds, that effect goes out as the subject's final, counting the
// attempt's effects there (leasehold.HeaderEffects) and naming the job
// that completed before it on the subject in this lease
// (leasehold.HeaderAfter), so that a sink reading the log knows when it
// holds the whole job, and that no job it skipped completed in between.
// When the attempt fails, an abort marker closes each subject it already
// published on; the held effects never leave. A job with one effect per
// subject sends exactly what it did before the protocol: its one effect,
// marked final. With Config.PackEffects, all of an attempt's effects on a
// subject are held, and leave packed in its final (see pack.go).
//
// Effects written through Job.Apply and Job.NextStamp, and messages
// stamped by hand, carry no job: they apply on their own.

// subjectOutput is what one attempt emitted on one subject.
type subjectOutput struct {
	subject string
	held    heldEffect // the latest effect, not sent yet
	// With Config.PackEffects, the effects held before the latest, in the
	// order they were held (see pack.go), and what all the held ones add
	// to a packed body at the most.
	packed []heldEffect
	bytes  int
	count  int  // effects emitted, the held ones included
	sent   bool // at least one left
}

// heldEffect is an effect held back until the handler returns.
type heldEffect struct {
	msg  *nats.Msg // nil: none
	key  string    // its idempotency key
	size int       // its entry in a packed body, at the most (with Config.PackEffects)
	// The size of the stamp, mark and message ID header lines Publish
	// put off (wireLines), until sendHeld writes them; 0 when written.
	unwritten int
	// msg's effectMsg, when the worker writes the compact stamp and mark
	// (setWire, in Publish or, put off, in sendHeld): its final's mark
	// is written in place (setFinal).
	wire *effectMsg
}

// indexOutputs is how many subjects an attempt uses before they are found
// through a map rather than by a look at each.
const indexOutputs = 8

// output returns the attempt's output on subject, or nil; j.mu is held.
// The pointer is good until the next subject is added.
func (j *Job) output(subject string) *subjectOutput {
	if j.index != nil {
		if i, ok := j.index[subject]; ok {
			return &j.outs[i]
		}
		return nil
	}
	for i := range j.outs {
		if j.outs[i].subject == subject {
			return &j.outs[i]
		}
	}
	return nil
}

// addOutput starts the attempt's output on subject; j.mu is held.
func (j *Job) addOutput(subject string) *subjectOutput {
	if j.outs == nil {
		j.outs = j.first[:0]
	}
	j.outs = append(j.outs, subjectOutput{subject: subject})
	switch n := len(j.outs); {
	case j.index != nil:
		j.index[subject] = n - 1
	case n > indexOutputs:
		j.index = make(map[string]int, 2*n)
		for i := range j.outs {
			j.index[j.outs[i].subject] = i
		}
	}
	return &j.outs[len(j.outs)-1]
}

// hold makes e the subject's held effect, and returns what may no longer
// be held, to be sent now as one message (sendHeld): the effect e
// replaces, and with Config.PackEffects, the ones held before it, when a
// packed message of them all and e would be too large or hold too many
// (see pack.go). room is what marking e final adds to its headers.
func (j *Job) hold(e heldEffect, room int) ([]heldEffect, heldEffect, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if err := j.usable(); err != nil {
		return nil, heldEffect{}, err
	}
	o := j.output(e.msg.Subject)
	if o == nil {
		o = j.addOutput(e.msg.Subject)
	}
	if o.count >= leasehold.MaxJobEffects {
		return nil, heldEffect{}, Permanent(&EffectError{Subject: e.msg.Subject, Key: e.key,
			Err: fmt.Errorf("the attempt emitted %d effects on this subject, the most a job may (leasehold.MaxJobEffects): split the work into more jobs", o.count)})
	}
	o.count++
	prev := o.held
	o.held = e
	if prev.msg == nil || !j.r.w.cfg.PackEffects {
		o.bytes = e.size
		return nil, prev, nil
	}
	if j.r.packFits(o, e, room) {
		if o.packed == nil {
			o.packed = make([]heldEffect, 0, 4)
		}
		o.packed = append(o.packed, prev)
		o.bytes += e.size
		return nil, heldEffect{}, nil
	}
	rest := o.packed
	o.packed, o.bytes = nil, e.size
	return rest, prev, nil
}

// sendHeld sends held effects as one message: last alone when rest is
// empty, else rest and last packed, in that order; with mark, the job
// mark of last, when it is the attempt's final.
func (j *Job) sendHeld(ctx context.Context, rest []heldEffect, last heldEffect, mark leasehold.JobMark) error {
	msg := last.msg
	if last.wire != nil && last.unwritten > 0 {
		// Its stamp, mark and message ID, put off while it was held
		// (wireLines); a pack takes the stamp and the message ID from
		// it.
		last.wire.setWire(j.r.info.Stamp(last.key), leasehold.JobMark{Job: j.Seq, Attempt: j.wire}, j.nonce[:])
	}
	switch {
	case len(rest) > 0:
		msg = j.pack(rest, last)
		mark.SetHeader(msg.Header)
	case mark.Final() && last.wire != nil && !mark.Standalone():
		last.wire.setFinal(mark)
	case mark.Final():
		mark.SetHeader(msg.Header)
	}
	return j.send(ctx, msg)
}

// finish sends, once the handler has returned nil, each subject's held
// effects as the attempt's final (packed, with Config.PackEffects, when
// there are several), and returns the publishes to wait for. after holds,
// per subject, the last job of this lease that completed with effects
// there; finish records j in it and remembers what it replaced, for a
// rewind to restore. A runner with several jobs in flight marks each
// final with its watermark floor (leasehold.HeaderFloor). The runner's
// goroutine alone calls it.
func (j *Job) finish(ctx context.Context, after map[string]uint64, floored bool, floor uint64) ([]jetstream.PubAckFuture, []afterUndo, error) {
	undo := j.undoBuf[:0]
	// The attempt is closed: no subject is added while this runs.
	for i := range j.outs {
		o := &j.outs[i]
		subject, last, rest := o.subject, o.held, o.packed
		o.held, o.packed = heldEffect{}, nil
		mark := leasehold.JobMark{Job: j.Seq, Attempt: j.wire, Effects: o.count, After: after[subject]}
		if floored {
			mark.Floor, mark.Floored = floor, true
		}
		if err := j.sendHeld(ctx, rest, last, mark); err != nil {
			j.fail(err)
			return nil, undo, err
		}
		undo = append(undo, afterUndo{subject: subject, prev: after[subject]})
		after[subject] = j.Seq
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.futs, undo, nil
}

// afterUndo is what a completed job changed in the runner's after map.
type afterUndo struct {
	subject string
	prev    uint64
}

// sentSubjects lists the subjects on which the attempt published effects.
func (j *Job) sentSubjects() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	var out []string
	for _, o := range j.outs {
		if o.sent {
			out = append(out, o.subject)
		}
	}
	return out
}

// AbortKey is the idempotency key of the abort marker of attempt (as
// numbered on the wire) of the job at seq of partition p. The worker gives
// it the job's origin (see Job.Origin), as it does its effects' keys.
func AbortKey(scope string, p leasehold.Partition, seq, attempt uint64) string {
	return scope + "." + p.String() + "." + strconv.FormatUint(seq, 10) + ".abort." + strconv.FormatUint(attempt, 10)
}

// abort closes, on each subject, an attempt that published effects there
// and did not complete, so that no sink waits for the rest of it. It is
// sent at once and waited for: a failing attempt is rare, and its marker
// should be in the log before the next attempt's effects. It is a
// courtesy: a sink drops the attempt anyway once a later attempt, a later
// job or a successor's barrier supersedes it, so a marker that cannot be
// sent (the lease is gone) is only logged.
func (r *runner) abort(job *Job, subjects []string) {
	if len(subjects) == 0 {
		return
	}
	seq, attempt, o := job.Seq, job.wire, job.Origin()
	stamp := r.info.Stamp(AbortKey(o.Scope, o.Partition, o.Seq, attempt))
	nonce := newNonce()
	for _, subject := range subjects {
		if err := r.sendable(); err != nil {
			r.log.Debug("an abort marker was not sent: the lease is gone, and a successor's barrier closes the attempt", "seq", seq, "subject", subject, "err", err)
			return
		}
		msg := &nats.Msg{Subject: subject, Header: nats.Header{}}
		r.stampHeader(r.ctx, msg.Header, stamp, nonce)
		leasehold.JobMark{Job: seq, Attempt: attempt, Abort: true}.SetHeader(msg.Header)
		if err := r.publishSync(context.WithoutCancel(r.ctx), msg, r.w.cfg.EffectTimeout); err != nil {
			r.log.Warn("an abort marker was not stored; sinks drop the attempt when a later one, a later job or a successor's barrier supersedes it", "seq", seq, "subject", subject, "err", err)
		}
	}
}

// unwind forgets, on a rewind, what the finals of the jobs in the window
// (completed, not done) did to the runner's after map, in the reverse of
// the order they were sent, empties the window, and puts its jobs, in the
// order they completed, at the head of the jobs to replay (replay.go).
// Their attempts need no abort marker: each is run again under a higher
// attempt number, naming in its finals what its first did, and should the
// lease end first, the successor's barrier settles them. The finals of
// jobs done above the watermark stay: those jobs are not run again.
func (r *runner) unwind() {
	for i := len(r.window) - 1; i >= 0; i-- {
		j := r.window[i]
		for k := len(j.undo) - 1; k >= 0; k-- {
			r.after[j.undo[k].subject] = j.undo[k].prev
		}
	}
	r.requeue(r.window)
	r.window = nil
}
