package workertest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// Result is what became of one job: its attempts, each with its error and
// what it published, and whether it is done, dead-lettered or stopped its
// partition. Its Require methods fail the test with what happened.
type Result struct {
	worker.InMemoryResult
	t testing.TB
}

// Err is the error of the job's last attempt: nil when it is done.
func (r *Result) Err() error {
	if len(r.Attempts) == 0 {
		return nil
	}
	return r.Attempts[len(r.Attempts)-1].Err
}

// Retries is the number of attempts after the first.
func (r *Result) Retries() int { return max(len(r.Attempts)-1, 0) }

// Effects is what the job's last attempt published, in the order it left
// the worker, abort markers left out: for a job that is done, the effects
// sinks apply. The last effect on each subject is held until the handler
// returns, so it leaves after the earlier effects of other subjects.
func (r *Result) Effects() []Effect {
	if len(r.Attempts) == 0 {
		return nil
	}
	return effectsOf(r.Attempts[len(r.Attempts)-1].Published)
}

// Key is the idempotency key of the job's index-th effect (counting every
// Publish, Emit, Apply and NextStamp of an attempt, from 0): the key of
// its origin, the same on every attempt and on every worker.
func (r *Result) Key(index int) string {
	if len(r.Attempts) == 0 {
		return ""
	}
	return r.Attempts[0].Job.Origin().EffectKey(index)
}

// String describes the outcome and every attempt's error.
func (r *Result) String() string {
	var b strings.Builder
	switch {
	case r.Done:
		fmt.Fprintf(&b, "job %d of partition %d is done", r.Seq, r.Partition)
	case r.DeadLetter != nil:
		fmt.Fprintf(&b, "job %d of partition %d was dead-lettered", r.Seq, r.Partition)
	case r.Stopped != nil:
		fmt.Fprintf(&b, "job %d of partition %d stopped its partition: %v", r.Seq, r.Partition, r.Stopped)
	default:
		fmt.Fprintf(&b, "job %d of partition %d did not run", r.Seq, r.Partition)
	}
	for i, a := range r.Attempts {
		fmt.Fprintf(&b, "\n  attempt %d: ", i+1)
		switch {
		case a.Err == nil:
			b.WriteString("succeeded")
		case a.Wait > 0:
			fmt.Fprintf(&b, "%v (then waits %v)", a.Err, a.Wait)
		default:
			fmt.Fprintf(&b, "%v", a.Err)
		}
	}
	return b.String()
}

// RequireDone fails the test unless an attempt succeeded.
func (r *Result) RequireDone() {
	r.t.Helper()
	if !r.Done {
		r.t.Fatalf("workertest: want the job done: %s", r)
	}
}

// RequireDeadLettered fails the test unless the job was dead-lettered,
// and returns its dead letter.
func (r *Result) RequireDeadLettered() DeadLetter {
	r.t.Helper()
	if r.DeadLetter == nil {
		r.t.Fatalf("workertest: want the job dead-lettered: %s", r)
	}
	return DeadLetter{Msg: r.DeadLetter, Error: r.DeadLetter.Header.Get(worker.HeaderError), Attempts: len(r.Attempts)}
}

// RequireStopped fails the test unless the job stopped its partition with
// an error matching target.
func (r *Result) RequireStopped(target error) {
	r.t.Helper()
	if r.Stopped == nil || !errors.Is(r.Stopped, target) {
		r.t.Fatalf("workertest: want the partition stopped with %v: %s", target, r)
	}
}

// RequireEffects fails the test unless the job's last attempt published
// exactly want, in order (subject and data; a nil Data matches any), each
// stamped by the harness's lease with the next idempotency key of the job
// (see Effect.Check).
func (r *Result) RequireEffects(want ...Want) []Effect {
	r.t.Helper()
	got := r.Effects()
	if len(got) != len(want) {
		r.t.Fatalf("workertest: want %d effects, got %d: %s\n%s", len(want), len(got), describe(got), r)
	}
	for i, w := range want {
		e := got[i]
		if e.Subject != w.Subject || w.Data != nil && !bytes.Equal(e.Data, w.Data) {
			r.t.Fatalf("workertest: effect %d is %s %q, want %s %q", i, e.Subject, e.Data, w.Subject, w.Data)
		}
	}
	if err := Check(r.Attempts[len(r.Attempts)-1].Job, got); err != nil {
		r.t.Fatalf("workertest: %v", err)
	}
	return got
}

// Want is an effect RequireEffects expects.
type Want struct {
	Subject string
	Data    []byte // nil: any
}

// DeadLetter is a job's dead letter as the worker stores it.
type DeadLetter struct {
	Msg      *nats.Msg
	Error    string // its Leasehold-Error: the last failure, on one line
	Attempts int    // the attempts run
}

// Effect is a message a handler published through its job, as it left
// the worker.
type Effect struct {
	Subject string
	Data    []byte
	Header  nats.Header
	// Stamp is read back from the headers; StampErr says why it could not
	// be.
	Stamp    leasehold.Stamp
	StampErr error
	// Mark is the job and attempt it belongs to, read back from the
	// headers; Mark.Final() is set on the attempt's last effect on the
	// subject.
	Mark leasehold.JobMark
	// MessageID is its Nats-Msg-Id: "<key>@<epoch>~<nonce>".
	MessageID string
}

// Decode decodes the effect's data as JSON into a T, failing the test if
// it does not decode.
func Decode[T any](t testing.TB, e Effect) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(e.Data, &v); err != nil {
		t.Fatalf("workertest: effect %s on %s is not a JSON %T: %v", e.Stamp.Key, e.Subject, v, err)
	}
	return v
}

// Check reports whether effects, the effects one attempt at job
// published, in the order they left, carry the stamps a worker gives
// them: the lease the job ran under, keys of the job's origin rising on
// each subject (the last effect on a subject leaves when the handler
// returns, after the earlier effects of other subjects), the job and
// attempt marks, the last one on each subject marked final counting the
// attempt's effects there, and message IDs made of the key and the epoch.
func Check(job *worker.Job, effects []Effect) error {
	o := job.Origin()
	next := map[string]int{} // per subject: the keys of one subject rise
	count := map[string]int{}
	for _, e := range effects {
		count[e.Subject]++
	}
	seen := map[string]int{}
	for i, e := range effects {
		if e.StampErr != nil {
			return fmt.Errorf("effect %d on %s: %w", i, e.Subject, e.StampErr)
		}
		if want := job.Lease.Stamp(e.Stamp.Key); e.Stamp != want {
			return fmt.Errorf("effect %d on %s is stamped %+v, want the lease's %+v", i, e.Subject, e.Stamp, want)
		}
		k := next[e.Subject]
		for ; k < next[e.Subject]+1<<16 && o.EffectKey(k) != e.Stamp.Key; k++ {
		}
		if o.EffectKey(k) != e.Stamp.Key {
			return fmt.Errorf("effect %d on %s has key %q, not a key of job %s after %q", i, e.Subject, e.Stamp.Key, o, o.EffectKey(next[e.Subject]))
		}
		next[e.Subject] = k + 1
		if !strings.HasPrefix(e.MessageID, e.Stamp.Key+"@"+e.Stamp.Epoch.String()+"~") {
			return fmt.Errorf("effect %d on %s has message ID %q, want %q and the attempt's nonce", i, e.Subject, e.MessageID, e.Stamp.Key+"@"+e.Stamp.Epoch.String()+"~")
		}
		seen[e.Subject]++
		final := seen[e.Subject] == count[e.Subject]
		switch {
		case e.Mark.Job != job.Seq:
			return fmt.Errorf("effect %d on %s is marked for job %d, want %d", i, e.Subject, e.Mark.Job, job.Seq)
		case e.Mark.Final() != final:
			return fmt.Errorf("effect %d on %s: final %v, want %v (the attempt's last effect on a subject is its final)", i, e.Subject, e.Mark.Final(), final)
		case final && e.Mark.Effects != count[e.Subject]:
			return fmt.Errorf("effect %d on %s: its final counts %d effects, the attempt published %d", i, e.Subject, e.Mark.Effects, count[e.Subject])
		}
	}
	return nil
}

func effectsOf(msgs []*nats.Msg) []Effect {
	var out []Effect
	for _, m := range msgs {
		mark, _ := leasehold.JobMarkFromHeader(m.Header)
		if mark.Abort || m.Header.Get(worker.HeaderError) != "" {
			continue
		}
		st, err := leasehold.StampFromHeader(m.Header)
		out = append(out, Effect{Subject: m.Subject, Data: m.Data, Header: m.Header, Stamp: st, StampErr: err, Mark: mark, MessageID: m.Header.Get(jetstream.MsgIDHeader)})
	}
	return out
}

func describe(es []Effect) string {
	var b strings.Builder
	for i, e := range es {
		fmt.Fprintf(&b, "  %d: %s %q key %s\n", i, e.Subject, e.Data, e.Stamp.Key)
	}
	return b.String()
}
