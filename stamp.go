package leasehold

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Header names of the stamp every effect carries. W3C trace context
// (traceparent, tracestate) travels beside them.
const (
	// HeaderScope names the fencing scope: the job stream (its prefix) for
	// partitions, "<namespace>/<name>" for a named lock.
	HeaderScope     = "Leasehold-Scope"
	HeaderPartition = "Leasehold-Partition"
	HeaderEpoch     = "Leasehold-Epoch"
	// HeaderAcquisition identifies the acquisition that issued the epoch, so
	// that two acquisitions handed one revision (a storage rollback) are
	// told apart.
	HeaderAcquisition = "Leasehold-Acquisition"
	HeaderKey         = "Leasehold-Key" // the effect's idempotency key
	HeaderWorker      = "Leasehold-Worker"
	// HeaderBarrier marks a barrier: a message with a stamp and no effect,
	// which a worker publishes into an effect log when it acquires a
	// partition, so that a sink consuming the log in order raises the
	// partition's fence before any later write of the previous holder.
	HeaderBarrier = "Leasehold-Barrier"
)

// MaxKeyLen bounds an idempotency key so that it fits a KV key, a
// Nats-Msg-Id and an indexed database column.
const MaxKeyLen = 256

// SinkHeaderRoom is the room, in bytes, a sink may take under the server's
// max payload for headers of its own when it stores an effect (a KV sink's
// batch and compare-and-set headers, a republished effect's trace context
// and message ID). Workers refuse an effect that leaves less, so that no
// sink is handed an effect it cannot store.
const SinkHeaderRoom = 1024

// Stamp is what a sink needs to fence an effect: the fence it belongs to
// (scope and partition), the epoch of the lease it was produced under and
// the acquisition that issued that epoch, and its idempotency key. Worker
// names the producing worker for logs and traces; it is informative and
// never trusted for fencing.
type Stamp struct {
	Scope       string
	Partition   Partition
	Epoch       Epoch
	Acquisition string
	Key         string
	Worker      string
}

// Fence is the fence s belongs to.
func (s Stamp) Fence() FenceID { return FenceID{Scope: s.Scope, Partition: s.Partition} }

// Validate reports whether s can be written as headers and read back.
func (s Stamp) Validate() error {
	if err := ValidateScope(s.Scope); err != nil {
		return &StampError{Header: HeaderScope, Value: s.Scope, Err: err}
	}
	if s.Epoch == 0 || s.Epoch > MaxEpoch {
		return &StampError{Header: HeaderEpoch, Value: s.Epoch.String(), Err: fmt.Errorf("epoch %d is outside 1..%d", s.Epoch, MaxEpoch)}
	}
	if s.Partition >= MaxPartitions {
		return &StampError{Header: HeaderPartition, Value: s.Partition.String(), Err: fmt.Errorf("partition %d is not below %d", s.Partition, MaxPartitions)}
	}
	if err := ValidateAcquisition(s.Acquisition); err != nil {
		return &StampError{Header: HeaderAcquisition, Value: s.Acquisition, Err: err}
	}
	if err := validKey(s.Key); err != nil {
		return &StampError{Header: HeaderKey, Value: s.Key, Err: err}
	}
	return nil
}

// SetHeader writes s into h in the legacy form, one header per field,
// replacing any values already there and removing HeaderStamp in any
// spelling. Every release reads this form; a worker writes the compact one
// (SetHeaderAs, StampCompact) unless told otherwise, and sinks write this
// one into what they hand on (a republished effect, a dead letter, a
// stored value), for readers that look the fields up by name.
// nats.Header and http.Header convert to h's type.
func (s Stamp) SetHeader(h map[string][]string) {
	deleteNamed(h, isCompactStampHeader)
	h[HeaderScope] = []string{s.Scope}
	h[HeaderPartition] = []string{s.Partition.String()}
	h[HeaderEpoch] = []string{s.Epoch.String()}
	h[HeaderAcquisition] = []string{s.Acquisition}
	h[HeaderKey] = []string{s.Key}
	if s.Worker != "" {
		h[HeaderWorker] = []string{s.Worker}
	} else {
		delete(h, HeaderWorker)
	}
}

// SetMetadata writes s into Watermill-style metadata, in the legacy form.
func (s Stamp) SetMetadata(m map[string]string) {
	for k := range m {
		if isCompactStampHeader(k) {
			delete(m, k)
		}
	}
	m[HeaderScope] = s.Scope
	m[HeaderPartition] = s.Partition.String()
	m[HeaderEpoch] = s.Epoch.String()
	m[HeaderAcquisition] = s.Acquisition
	m[HeaderKey] = s.Key
	if s.Worker != "" {
		m[HeaderWorker] = s.Worker
	}
}

// StampFromHeader reads a stamp from message headers, in either form (see
// HeaderStamp), never both. Names match without regard to case, since
// proxies and other clients may lower-case them; a header given twice
// with different values is an error.
func StampFromHeader(h map[string][]string) (Stamp, error) {
	// One pass over h gathers every spelling of every stamp header; a
	// lookup per name would walk h once per name, on every message a sink
	// reads.
	var f stampFields
	for k, vs := range h {
		if i := stampHeaderIndex(k); i >= 0 {
			for _, v := range vs {
				f.add(i, v)
			}
		}
	}
	return f.stamp()
}

// StampFromMetadata reads a stamp from Watermill-style metadata, with the
// rules of StampFromHeader.
func StampFromMetadata(m map[string]string) (Stamp, error) {
	var f stampFields
	for k, v := range m {
		if i := stampHeaderIndex(k); i >= 0 {
			f.add(i, v)
		}
	}
	return f.stamp()
}

// stampFields is what a message says under each of stampHeaders.
type stampFields struct {
	v        [len(stampHeaders)]string
	n        [len(stampHeaders)]int
	conflict [len(stampHeaders)]bool
}

func (f *stampFields) add(i int, v string) {
	if f.n[i] == 0 {
		f.v[i] = v
	} else if v != f.v[i] {
		f.conflict[i] = true
	}
	f.n[i]++
}

func (f *stampFields) stamp() (Stamp, error) {
	if f.n[compactStampIndex] > 0 {
		for i := range compactStampIndex {
			if f.n[i] > 0 {
				return Stamp{}, &StampError{Header: stampHeaders[i], Value: f.v[i], Err: errBothStamps}
			}
		}
		if f.conflict[compactStampIndex] {
			return Stamp{}, &StampError{Header: HeaderStamp, Value: f.v[compactStampIndex], Err: errConflict}
		}
		return ParseStamp(f.v[compactStampIndex])
	}
	return parseStamp(func(name string) (string, error) {
		i := stampHeaderIndex(name)
		switch {
		case f.n[i] == 0:
			return "", errMissing
		case f.conflict[i]:
			return "", errConflict
		}
		return f.v[i], nil
	})
}

// stampHeaders are the headers a stamp is read from: the legacy form's,
// then the compact form's.
var stampHeaders = [...]string{HeaderScope, HeaderPartition, HeaderEpoch, HeaderAcquisition, HeaderKey, HeaderWorker, HeaderStamp}

// compactStampIndex is HeaderStamp's index in stampHeaders.
const compactStampIndex = 6

func isCompactStampHeader(k string) bool { return stampHeaderIndex(k) == compactStampIndex }

// stampHeaderIndex returns the index in stampHeaders of the header name,
// matched without regard to case, or -1.
func stampHeaderIndex(name string) int {
	switch name {
	case HeaderScope:
		return 0
	case HeaderPartition:
		return 1
	case HeaderEpoch:
		return 2
	case HeaderAcquisition:
		return 3
	case HeaderKey:
		return 4
	case HeaderWorker:
		return 5
	case HeaderStamp:
		return compactStampIndex
	}
	const prefix = "Leasehold-"
	if len(name) <= len(prefix) || !strings.EqualFold(name[:len(prefix)], prefix) {
		return -1
	}
	for i, h := range stampHeaders {
		if len(h) == len(name) && strings.EqualFold(h, name) {
			return i
		}
	}
	return -1
}

var (
	errMissing  = errors.New("is missing")
	errConflict = errors.New("is given more than once with different values")
)

func parseStamp(get func(string) (string, error)) (Stamp, error) {
	var s Stamp
	v, err := get(HeaderScope)
	if err == nil {
		err = ValidateScope(v)
	}
	if err != nil {
		return Stamp{}, &StampError{Header: HeaderScope, Value: v, Err: err}
	}
	s.Scope = v
	v, err = get(HeaderPartition)
	if err == nil {
		s.Partition, err = ParsePartition(v)
	}
	if err != nil {
		return Stamp{}, &StampError{Header: HeaderPartition, Value: v, Err: err}
	}
	v, err = get(HeaderEpoch)
	if err == nil {
		s.Epoch, err = ParseEpoch(v)
	}
	if err != nil {
		return Stamp{}, &StampError{Header: HeaderEpoch, Value: v, Err: err}
	}
	v, err = get(HeaderAcquisition)
	if err == nil {
		err = ValidateAcquisition(v)
	}
	if err != nil {
		return Stamp{}, &StampError{Header: HeaderAcquisition, Value: v, Err: err}
	}
	s.Acquisition = v
	v, err = get(HeaderKey)
	if err == nil {
		err = validKey(v)
	}
	if err != nil {
		return Stamp{}, &StampError{Header: HeaderKey, Value: v, Err: err}
	}
	s.Key = v
	if w, err := get(HeaderWorker); err == nil {
		s.Worker = w
	}
	return s, nil
}

func validKey(k string) error {
	switch {
	case k == "":
		return errors.New("idempotency key is empty")
	case len(k) > MaxKeyLen:
		return fmt.Errorf("idempotency key is %d bytes long; the limit is %d", len(k), MaxKeyLen)
	}
	for i := 0; i < len(k); i++ {
		if c := k[i]; c <= ' ' || c == 0x7f {
			return fmt.Errorf("idempotency key holds the control or space byte %s", strconv.QuoteRune(rune(c)))
		}
	}
	return nil
}

// BarrierKey is the idempotency key of the barrier for epoch e of
// partition p.
func BarrierKey(scope string, p Partition, e Epoch) string {
	return scope + "." + p.String() + ".barrier." + e.String()
}

// EffectKey derives the idempotency key of the index-th effect a handler
// emits while handling the job at input sequence seq of partition p. The same
// job re-run after a fail-over emits the same keys, so a deduping sink
// applies each effect once. scope separates job streams that share a sink.
func EffectKey(scope string, p Partition, seq uint64, index int) string {
	// One allocation: the builder's buffer becomes the string.
	var b strings.Builder
	b.Grow(len(scope) + 3 + 5 + 20 + 20)
	var num [20]byte
	b.WriteString(scope)
	b.WriteByte('.')
	b.Write(strconv.AppendUint(num[:0], uint64(p), 10))
	b.WriteByte('.')
	b.Write(strconv.AppendUint(num[:0], seq, 10))
	b.WriteByte('.')
	b.Write(strconv.AppendInt(num[:0], int64(index), 10))
	return b.String()
}
