package leasehold

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Header names of a job's effects, beside the stamp. An effect a worker
// publishes for a job carries the job and the attempt; the attempt's last
// effect on a subject is its final, which also says how many effects the
// attempt published there and which job completed before it. A sink that
// consumes the log applies a job's effects on a subject all together, once
// it holds the final and every effect it counts, and never those of an
// attempt that did not complete. An effect with no HeaderJob stands alone
// and is applied on its own.
const (
	HeaderJob     = "Leasehold-Job"     // the job's input sequence
	HeaderAttempt = "Leasehold-Attempt" // the attempt, rising within a lease
	HeaderEffects = "Leasehold-Effects" // on the final: the attempt's effects on its subject, the final included
	// HeaderAfter is on the final: the job, in the same lease, whose
	// attempt completed last before this one with effects on the subject;
	// 0 when none did. Without HeaderFloor it is below the job; with it,
	// jobs complete out of order and it may name a later job.
	HeaderAfter = "Leasehold-After"
	// HeaderFloor is on the final of a runner with several jobs of the
	// partition in flight: its watermark when it sent the final. Every job
	// of the lease up to the floor is finished (its finals, if any, are in
	// the log before this one, and it publishes nothing more), while jobs
	// above it may complete in any order. A final without it comes from a
	// runner that completes jobs in stream order, whose every earlier job
	// is finished.
	HeaderFloor = "Leasehold-Floor"
	// HeaderAbort marks a message with no effect that closes an attempt
	// which published effects on its subject and then failed.
	HeaderAbort = "Leasehold-Abort"
)

// MaxJobEffects bounds HeaderEffects: the effects one attempt may publish
// on one subject.
const MaxJobEffects = 1 << 20

// MaxAttempt bounds HeaderAttempt.
const MaxAttempt = 1 << 53

// JobMark is what a message says of the job that published it.
type JobMark struct {
	Job     uint64 // the job's input sequence; 0: the effect stands alone
	Attempt uint64
	// Effects is set on the attempt's final: how many effects it published
	// on the subject, the final included.
	Effects int
	After   uint64 // on the final: see HeaderAfter
	// Floor is on the final when Floored: see HeaderFloor. A floor of 0
	// (no job of the stream finished yet) is a floor all the same: a runner
	// with several jobs in flight sets Floored on each final it sends, and
	// SetHeader writes the floor when Floored or Floor is not 0.
	Floor   uint64
	Floored bool
	Abort   bool // the message closes the attempt: it is no effect
}

// Standalone reports whether the message belongs to no job.
func (m JobMark) Standalone() bool { return m.Job == 0 }

// Final reports whether the message is its attempt's last effect.
func (m JobMark) Final() bool { return m.Effects > 0 }

// SetHeader writes m into h in the form of the stamp h carries: the
// compact HeaderMark beside a compact stamp (HeaderStamp, as SetHeaderAs
// writes it), the legacy per-field headers otherwise. The other form's job
// headers are removed; a standalone mark removes them all.
func (m JobMark) SetHeader(h map[string][]string) {
	f := StampLegacy
	if _, ok := h[HeaderStamp]; ok {
		f = StampCompact
	}
	m.SetHeaderAs(h, f)
}

func (m JobMark) setLegacy(h map[string][]string) {
	deleteNamed(h, isCompactMarkHeader)
	for _, k := range jobHeaders[:compactMarkIndex] {
		delete(h, k)
	}
	if m.Standalone() {
		return
	}
	h[HeaderJob] = []string{strconv.FormatUint(m.Job, 10)}
	h[HeaderAttempt] = []string{strconv.FormatUint(m.Attempt, 10)}
	switch {
	case m.Abort:
		h[HeaderAbort] = []string{"1"}
	case m.Final():
		h[HeaderEffects] = []string{strconv.Itoa(m.Effects)}
		h[HeaderAfter] = []string{strconv.FormatUint(m.After, 10)}
		if m.Floored || m.Floor != 0 {
			h[HeaderFloor] = []string{strconv.FormatUint(m.Floor, 10)}
		}
	}
}

// Floors reports whether the final carries a floor: its job may complete
// out of stream order.
func (m JobMark) Floors() bool { return m.Final() && (m.Floored || m.Floor != 0) }

// jobHeaders are the headers a job mark is read from: the legacy form's,
// then the compact form's.
var jobHeaders = [...]string{HeaderJob, HeaderAttempt, HeaderEffects, HeaderAfter, HeaderAbort, HeaderFloor, HeaderMark}

// compactMarkIndex is HeaderMark's index in jobHeaders.
const compactMarkIndex = 6

func isCompactMarkHeader(k string) bool { return jobHeaderIndex(k) == compactMarkIndex }

// ErrBadJobMark is matched by the error of JobMarkFromHeader.
var ErrBadJobMark = errors.New("leasehold: malformed job headers")

// JobMarkError reports a job header that is missing, malformed or out of
// place.
type JobMarkError struct {
	Header string
	Value  string
	Err    error
}

func (e *JobMarkError) Error() string {
	return fmt.Sprintf("leasehold: header %s %q: %v: effects of a job carry Leasehold-Mark (1 <job> <attempt>, and on their final 1 <job> <attempt> <effects> <after>[ <floor>]) (or, in the legacy form, Leasehold-Job, Leasehold-Attempt, Leasehold-Effects, Leasehold-After and Leasehold-Floor), as the worker writes them", e.Header, e.Value, e.Err)
}

// Is makes errors.Is(err, ErrBadJobMark) true.
func (e *JobMarkError) Is(target error) bool { return target == ErrBadJobMark }

// Unwrap returns what is wrong.
func (e *JobMarkError) Unwrap() error { return e.Err }

// JobMarkFromHeader reads the job headers of a message, in either form
// (see HeaderMark), never both, strictly: names match without regard to
// case, a header given twice with different values is an error, numbers
// are canonical decimals within bounds, and a header out of place (an
// abort that counts effects, a final with no attempt, a floor on what is
// no final, a floor not below the job, an After naming the job itself, or
// not below it on a final without a floor) is an error. A message with
// none of the headers is standalone.
func JobMarkFromHeader(h map[string][]string) (JobMark, error) {
	var f markFields
	for k, vs := range h {
		if i := jobHeaderIndex(k); i >= 0 {
			for _, v := range vs {
				if err := f.add(i, v); err != nil {
					return JobMark{}, err
				}
			}
		}
	}
	return f.mark()
}

// JobMarkFromMetadata reads a job mark from Watermill-style metadata, with
// the rules of JobMarkFromHeader.
func JobMarkFromMetadata(md map[string]string) (JobMark, error) {
	var f markFields
	for k, v := range md {
		if i := jobHeaderIndex(k); i >= 0 {
			if err := f.add(i, v); err != nil {
				return JobMark{}, err
			}
		}
	}
	return f.mark()
}

// markFields is what a message says under each of jobHeaders.
type markFields struct {
	vals [len(jobHeaders)]string
	seen [len(jobHeaders)]bool
	any  bool
}

func (f *markFields) add(i int, v string) error {
	if f.seen[i] && v != f.vals[i] {
		return &JobMarkError{Header: jobHeaders[i], Value: v, Err: errConflict}
	}
	f.vals[i], f.seen[i], f.any = v, true, true
	return nil
}

func (f *markFields) mark() (JobMark, error) {
	if !f.any {
		return JobMark{}, nil
	}
	if f.seen[compactMarkIndex] {
		for i := range compactMarkIndex {
			if f.seen[i] {
				return JobMark{}, &JobMarkError{Header: jobHeaders[i], Value: f.vals[i], Err: errBothMarks}
			}
		}
		return ParseJobMark(f.vals[compactMarkIndex])
	}
	vals, seen := &f.vals, &f.seen
	bad := func(i int, err error) (JobMark, error) {
		return JobMark{}, &JobMarkError{Header: jobHeaders[i], Value: vals[i], Err: err}
	}
	var m JobMark
	var err error
	if !seen[0] {
		return bad(0, errors.New("is missing beside other job headers"))
	}
	if m.Job, err = parseCanonical(vals[0], 1<<63); err != nil || m.Job == 0 {
		return bad(0, orZero(err))
	}
	if !seen[1] {
		return bad(1, errMissing)
	}
	if m.Attempt, err = parseCanonical(vals[1], MaxAttempt); err != nil || m.Attempt == 0 {
		return bad(1, orZero(err))
	}
	if seen[4] {
		if vals[4] != "1" {
			return bad(4, errors.New(`is not "1"`))
		}
		if seen[2] || seen[3] || seen[5] {
			return bad(4, errors.New("is given beside Leasehold-Effects, Leasehold-After or Leasehold-Floor: an abort marker counts no effects"))
		}
		m.Abort = true
		return m, nil
	}
	if seen[2] != seen[3] {
		if !seen[2] {
			return bad(2, errors.New("is missing beside Leasehold-After"))
		}
		return bad(3, errors.New("is missing beside Leasehold-Effects"))
	}
	if !seen[2] {
		if seen[5] {
			return bad(5, errors.New("is given on an effect that is not its attempt's final"))
		}
		return m, nil
	}
	n, err := parseCanonical(vals[2], MaxJobEffects)
	if err != nil || n == 0 {
		return bad(2, orZero(err))
	}
	m.Effects = int(n)
	if m.After, err = parseCanonical(vals[3], 1<<63); err != nil {
		return bad(3, err)
	}
	if seen[5] {
		if m.Floor, err = parseCanonical(vals[5], 1<<63); err != nil {
			return bad(5, err)
		}
		if m.Floor >= m.Job {
			return bad(5, fmt.Errorf("is %d, not below job %d: the floor counts finished jobs, and this one is finishing", m.Floor, m.Job))
		}
		m.Floored = true
		if m.After == m.Job {
			return bad(3, fmt.Errorf("names job %d itself", m.Job))
		}
		return m, nil
	}
	if m.After >= m.Job {
		return bad(3, fmt.Errorf("names job %d, not one before job %d, on a final without Leasehold-Floor", m.After, m.Job))
	}
	return m, nil
}

func orZero(err error) error {
	if err != nil {
		return err
	}
	return errors.New("is zero, and it counts from 1")
}

// jobHeaderIndex returns the index in jobHeaders of name, matched without
// regard to case, or -1.
func jobHeaderIndex(name string) int {
	const prefix = "Leasehold-"
	if len(name) <= len(prefix) || !strings.EqualFold(name[:len(prefix)], prefix) {
		return -1
	}
	for i, h := range jobHeaders {
		if len(h) == len(name) && strings.EqualFold(h, name) {
			return i
		}
	}
	return -1
}
