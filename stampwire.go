package leasehold

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unsafe"
)

// The compact wire form of a stamp and a job mark: one header each, in
// place of the ten or so per-field headers (HeaderScope and the others,
// HeaderJob and the others) that releases before it wrote.
//
//	Leasehold-Stamp: 1 <scope> <partition> <epoch> <acquisition> <key>[ <worker>]
//	Leasehold-Mark: 1 <job> <attempt>                              an effect
//	Leasehold-Mark: 1 <job> <attempt> <effects> <after>            its attempt's final
//	Leasehold-Mark: 1 <job> <attempt> <effects> <after> <floor>    a final with a floor
//	Leasehold-Mark: 1 <job> <attempt> abort                        an abort marker
//
// The first field is the version of the form, "1". Fields are separated
// by exactly one space (0x20), with none before the first or after the
// last; no field is empty, and none can hold a space (scopes, keys,
// acquisitions and workers never do). Numbers are canonical decimals (no
// sign, no leading zero) within the bounds of their per-field headers.
// The worker is informative and may be left off; when present it is 1 to
// MaxWorkerLen bytes of printable ASCII.
//
// A reader takes either form of each, never both: a message carrying
// HeaderStamp beside any per-field stamp header, or HeaderMark beside any
// per-field job header, is malformed, whatever the values say, so that no
// two readers can take one message for two stamps. The stamp and the mark
// are read each on its own: a stamp in one form and a mark in the other
// are one stamp and one mark.
const (
	HeaderStamp = "Leasehold-Stamp"
	HeaderMark  = "Leasehold-Mark"
)

// wireVersion is the version the compact form's first field names.
const wireVersion = "1"

// MaxWorkerLen bounds the worker a compact stamp names.
const MaxWorkerLen = 128

// MaxStampLen bounds a HeaderStamp value: what the longest scope,
// partition, epoch, acquisition, key and worker take, with the version and
// the spaces between them.
const MaxStampLen = len(wireVersion) + 1 + MaxScopeLen + 1 + 5 + 1 + 19 + 1 + MaxAcquisitionLen + 1 + MaxKeyLen + 1 + MaxWorkerLen

// MaxMarkLen bounds a HeaderMark value: version, job (19 digits), attempt
// (16), effects (7), after (19) and floor (19) with their spaces.
const MaxMarkLen = len(wireVersion) + 1 + 19 + 1 + 16 + 1 + 7 + 1 + 19 + 1 + 19

// StampFormat is the form in which a writer puts stamps and job marks on
// the wire. Readers take both for one release (see HeaderStamp); writers
// choose one.
type StampFormat uint8

const (
	// StampCompact writes HeaderStamp and HeaderMark: the default.
	StampCompact StampFormat = iota
	// StampLegacy writes one header per field (HeaderScope and the
	// others), as releases before the compact form did and read. A worker
	// writes it while sinks of the release before are still running: see
	// the upgrade order in the sink contract guide.
	StampLegacy
)

// String names f as ParseStampFormat reads it.
func (f StampFormat) String() string {
	switch f {
	case StampCompact:
		return "compact"
	case StampLegacy:
		return "legacy"
	}
	return "StampFormat(" + strconv.Itoa(int(f)) + ")"
}

// Validate reports whether f is a known format.
func (f StampFormat) Validate() error {
	if f > StampLegacy {
		return fmt.Errorf("stamp format %d: use StampCompact or StampLegacy", int(f))
	}
	return nil
}

// ParseStampFormat reads "compact" or "legacy".
func ParseStampFormat(s string) (StampFormat, error) {
	switch s {
	case "compact":
		return StampCompact, nil
	case "legacy":
		return StampLegacy, nil
	}
	return 0, fmt.Errorf("stamp format %q: use compact (the default) or legacy (while sinks of the release before run)", s)
}

// Compact formats s as HeaderStamp carries it. A worker that is not 1 to
// MaxWorkerLen bytes of printable ASCII without spaces is left off: it is
// informative.
func (s Stamp) Compact() string {
	b := s.AppendCompact(make([]byte, 0, s.compactRoom()))
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// compactRoom is at least the length of s's compact form.
func (s Stamp) compactRoom() int {
	return len(wireVersion) + len(s.Scope) + len(s.Acquisition) + len(s.Key) + len(s.Worker) + 48
}

// AppendCompact appends s's HeaderStamp value (Compact) to b: a writer
// that puts several values in one buffer makes one allocation for all.
func (s Stamp) AppendCompact(b []byte) []byte {
	b = append(b, wireVersion...)
	b = append(b, ' ')
	b = append(b, s.Scope...)
	b = append(b, ' ')
	b = strconv.AppendUint(b, uint64(s.Partition), 10)
	b = append(b, ' ')
	b = strconv.AppendUint(b, uint64(s.Epoch), 10)
	b = append(b, ' ')
	b = append(b, s.Acquisition...)
	b = append(b, ' ')
	b = append(b, s.Key...)
	if s.Worker != "" && validWorker(s.Worker) == nil {
		b = append(b, ' ')
		b = append(b, s.Worker...)
	}
	return b
}

// SetHeaderAs writes s into h in format f, removing the other format's
// stamp headers, in any spelling. See SetHeader for the legacy form.
func (s Stamp) SetHeaderAs(h map[string][]string, f StampFormat) {
	if f != StampCompact {
		s.SetHeader(h)
		return
	}
	deleteNamed(h, isLegacyStampHeader)
	h[HeaderStamp] = []string{s.Compact()}
}

// ParseStamp reads a HeaderStamp value, strictly (see HeaderStamp). The
// stamp's strings are parts of v: reading allocates nothing but an error.
func ParseStamp(v string) (Stamp, error) {
	bad := func(field string, err error) (Stamp, error) {
		if field != "" {
			err = fmt.Errorf("%s: %w", field, err)
		}
		return Stamp{}, &StampError{Header: HeaderStamp, Value: v, Err: err}
	}
	if len(v) > MaxStampLen {
		return bad("", fmt.Errorf("is %d bytes long; the limit is %d", len(v), MaxStampLen))
	}
	rest, ok := strings.CutPrefix(v, wireVersion+" ")
	if !ok {
		return bad("", errVersion)
	}
	var s Stamp
	var f string
	var err error
	if f, rest, ok = strings.Cut(rest, " "); !ok {
		return bad("", errFields)
	}
	if err = ValidateScope(f); err != nil {
		return bad("scope", err)
	}
	s.Scope = f
	if f, rest, ok = strings.Cut(rest, " "); !ok {
		return bad("", errFields)
	}
	if s.Partition, err = ParsePartition(f); err != nil {
		return bad("", err)
	}
	if f, rest, ok = strings.Cut(rest, " "); !ok {
		return bad("", errFields)
	}
	if s.Epoch, err = ParseEpoch(f); err != nil {
		return bad("", err)
	}
	if f, rest, ok = strings.Cut(rest, " "); !ok {
		return bad("", errFields)
	}
	if err = ValidateAcquisition(f); err != nil {
		return bad("acquisition", err)
	}
	s.Acquisition = f
	f, rest, ok = strings.Cut(rest, " ")
	if err = validKey(f); err != nil {
		return bad("key", err)
	}
	s.Key = f
	if ok {
		if err = validWorker(rest); err != nil {
			return bad("worker", err)
		}
		s.Worker = rest
	}
	return s, nil
}

var (
	errVersion    = errors.New(`does not start with the version "1" and a space: this release reads version 1 (or the per-field headers)`)
	errFields     = errors.New("has too few fields, or two spaces in a row")
	errBothStamps = errors.New("is given beside " + HeaderStamp + ": a stamp is in one form or the other, never both")
	errBothMarks  = errors.New("is given beside " + HeaderMark + ": a job mark is in one form or the other, never both")
)

// validWorker reports whether w can be the worker of a compact stamp.
func validWorker(w string) error {
	switch {
	case w == "":
		return errors.New("is empty")
	case len(w) > MaxWorkerLen:
		return fmt.Errorf("is %d bytes long; the limit is %d", len(w), MaxWorkerLen)
	}
	for i := 0; i < len(w); i++ {
		if c := w[i]; c <= ' ' || c >= 0x7f {
			return fmt.Errorf("holds the byte %#x: use printable ASCII without spaces", c)
		}
	}
	return nil
}

// Compact formats m as HeaderMark carries it; "" for a standalone mark,
// which no header carries.
func (m JobMark) Compact() string {
	if m.Standalone() {
		return ""
	}
	b := m.AppendCompact(make([]byte, 0, markRoom))
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// markRoom is at least the length of a job mark's compact form.
const markRoom = len(wireVersion) + 2 + 20 + 17 + 8 + 20 + 20 + 21

// AppendCompact appends m's HeaderMark value (Compact) to b, nothing for
// a standalone mark.
func (m JobMark) AppendCompact(b []byte) []byte {
	if m.Standalone() {
		return b
	}
	b = append(b, wireVersion...)
	b = append(b, ' ')
	b = strconv.AppendUint(b, m.Job, 10)
	b = append(b, ' ')
	b = strconv.AppendUint(b, m.Attempt, 10)
	switch {
	case m.Abort:
		b = append(b, " abort"...)
	case m.Final():
		b = append(b, ' ')
		b = strconv.AppendUint(b, uint64(m.Effects), 10)
		b = append(b, ' ')
		b = strconv.AppendUint(b, m.After, 10)
		if m.Floored || m.Floor != 0 {
			b = append(b, ' ')
			b = strconv.AppendUint(b, m.Floor, 10)
		}
	}
	return b
}

// SetHeaderAs writes m into h in format f, removing the other format's job
// headers, in any spelling; a standalone mark removes them all.
func (m JobMark) SetHeaderAs(h map[string][]string, f StampFormat) {
	if f != StampCompact {
		m.setLegacy(h)
		return
	}
	deleteNamed(h, func(k string) bool { return jobHeaderIndex(k) >= 0 })
	if !m.Standalone() {
		h[HeaderMark] = []string{m.Compact()}
	}
}

// ParseJobMark reads a HeaderMark value, strictly (see HeaderMark), with
// the rules of JobMarkFromHeader.
func ParseJobMark(v string) (JobMark, error) {
	bad := func(field string, err error) (JobMark, error) {
		if field != "" {
			err = fmt.Errorf("%s: %w", field, err)
		}
		return JobMark{}, &JobMarkError{Header: HeaderMark, Value: v, Err: err}
	}
	if len(v) > MaxMarkLen {
		return bad("", fmt.Errorf("is %d bytes long; the limit is %d", len(v), MaxMarkLen))
	}
	rest, ok := strings.CutPrefix(v, wireVersion+" ")
	if !ok {
		return bad("", errVersion)
	}
	var f [5]string
	n := 0
	for ; n < len(f); n++ {
		f[n], rest, ok = strings.Cut(rest, " ")
		if f[n] == "" {
			return bad("", errFields)
		}
		if !ok {
			n++
			break
		}
	}
	if ok {
		return bad("", errors.New("has more than six fields"))
	}
	var m JobMark
	var err error
	if m.Job, err = parseCanonical(f[0], 1<<63); err != nil || m.Job == 0 {
		return bad("job", orZero(err))
	}
	if n < 2 {
		return bad("", errFields)
	}
	if m.Attempt, err = parseCanonical(f[1], MaxAttempt); err != nil || m.Attempt == 0 {
		return bad("attempt", orZero(err))
	}
	switch n {
	case 2:
		return m, nil
	case 3:
		if f[2] != "abort" {
			return bad("", errors.New(`has a third field that is not "abort": a final counts its effects and names the job after which it completed`))
		}
		m.Abort = true
		return m, nil
	}
	e, err := parseCanonical(f[2], MaxJobEffects)
	if err != nil || e == 0 {
		return bad("effects", orZero(err))
	}
	m.Effects = int(e)
	if m.After, err = parseCanonical(f[3], 1<<63); err != nil {
		return bad("after", err)
	}
	if n == 5 {
		if m.Floor, err = parseCanonical(f[4], 1<<63); err != nil {
			return bad("floor", err)
		}
		if m.Floor >= m.Job {
			return bad("floor", fmt.Errorf("is %d, not below job %d: the floor counts finished jobs, and this one is finishing", m.Floor, m.Job))
		}
		if m.After == m.Job {
			return bad("after", fmt.Errorf("names job %d itself", m.Job))
		}
		m.Floored = true
		return m, nil
	}
	if m.After >= m.Job {
		return bad("after", fmt.Errorf("names job %d, not one before job %d, on a final without a floor", m.After, m.Job))
	}
	return m, nil
}

// HasStamp reports whether h carries any stamp header, in either form and
// any spelling: a reader that lets unstamped messages by must still judge
// (and refuse, when malformed) every message that tries to carry one.
func HasStamp(h map[string][]string) bool {
	for k := range h {
		if stampHeaderIndex(k) >= 0 {
			return true
		}
	}
	return false
}

// deleteNamed deletes from h every name that is.
func deleteNamed(h map[string][]string, is func(string) bool) {
	for k := range h {
		if is(k) {
			delete(h, k)
		}
	}
}

func isLegacyStampHeader(k string) bool {
	i := stampHeaderIndex(k)
	return i >= 0 && i != compactStampIndex
}

// IsStampHeader reports whether name, in any spelling, is a header of the
// stamp or of the job mark, in either form: the headers a worker alone
// writes, and a reader takes through StampFromHeader and
// JobMarkFromHeader.
func IsStampHeader(name string) bool {
	return stampHeaderIndex(name) >= 0 || jobHeaderIndex(name) >= 0
}
