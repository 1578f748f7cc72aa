package leasehold

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"strconv"
	"strings"
)

// The packed form of a job's effects: several effects one attempt emits on
// one subject, in one log message, so that a sink fetches, decides,
// acknowledges and positions one message where it would have done as many.
//
//	Leasehold-Pack: 1 <n>
//
// names a packed message of n effects (2 <= n <= MaxPackEffects; version
// "1", one space, n in canonical decimal). Its stamp is the stamp of its
// last effect, and its job mark the one that effect would carry alone: the
// attempt's final when the message ends the attempt on its subject (its
// Effects counting all of the attempt's effects there, packed or not),
// otherwise the plain mark of the job and attempt. A packed message is
// never a barrier, an abort marker or a standalone effect.
//
// Its body is the n effects, one after another, each:
//
//	uvarint(len(key)) key
//	uvarint(h) then h times uvarint(len(name)) name uvarint(len(value)) value
//	uvarint(len(data)) data
//
// with nothing after the last. A name given in several pairs has several
// values. Every key is a valid idempotency key, the keys are distinct, and
// the last one is the stamp's. An effect's header names are valid header
// field names, and none is leasehold's to write on the message itself: no
// stamp or job mark header (IsStampHeader), no HeaderPack, no
// HeaderBarrier, and nothing in the server's Nats- namespace, in any
// spelling. A message that breaks any of these rules is malformed as a
// whole: a sink applies none of it.
//
// A sink expands a packed message into the effects it holds, each with the
// message's subject, its own headers, and the stamp and job mark it would
// have carried alone, all at the message's log position. A sink of a
// release before this form takes the message for one effect, its last,
// with the packed body for data, and never applies the job: every sink
// runner that reads a log is upgraded before workers pack effects into it.
const HeaderPack = "Leasehold-Pack"

// MaxPackEffects bounds the effects of one packed message. A packed message
// is one log message, within the server's max payload (1 MiB by default):
// with effects of a few hundred bytes each, 4096 of them fill it, and a
// sink holds them all at once while it decides them.
const MaxPackEffects = 4096

// packVersion is the version HeaderPack names.
const packVersion = "1"

// ErrBadPack is matched by the errors of PackCount and Unpack.
var ErrBadPack = errors.New("leasehold: malformed packed effects")

// PackError reports a packed message that cannot be read: its header, or
// an entry of its body (Entry counts from 0; -1 for the header or the body
// as a whole).
type PackError struct {
	Entry int
	Err   error
}

func (e *PackError) Error() string {
	if e.Entry < 0 {
		return fmt.Sprintf("leasehold: packed effects: %v: a packed message is written by a leasehold worker, see leasehold.HeaderPack", e.Err)
	}
	return fmt.Sprintf("leasehold: packed effects: entry %d: %v: a packed message is written by a leasehold worker, see leasehold.HeaderPack", e.Entry, e.Err)
}

// Is makes errors.Is(err, ErrBadPack) true.
func (e *PackError) Is(target error) bool { return target == ErrBadPack }

// Unwrap returns what is wrong.
func (e *PackError) Unwrap() error { return e.Err }

// PackedEffect is one effect of a packed message.
type PackedEffect struct {
	Key    string
	Header map[string][]string // the effect's own headers: trace context, the caller's
	Data   []byte
}

// PackedSize returns how many bytes AppendPacked adds for e.
func PackedSize(e PackedEffect) int {
	n := uvarintLen(uint64(len(e.Key))) + len(e.Key)
	pairs := 0
	for k, vs := range e.Header {
		for _, v := range vs {
			pairs++
			n += uvarintLen(uint64(len(k))) + len(k) + uvarintLen(uint64(len(v))) + len(v)
		}
	}
	n += uvarintLen(uint64(pairs))
	return n + uvarintLen(uint64(len(e.Data))) + len(e.Data)
}

// AppendPacked appends e, as an entry of a packed body, to body. It writes
// what it is given: the rules a reader enforces (see HeaderPack) are the
// caller's to keep.
func AppendPacked(body []byte, e PackedEffect) []byte {
	body = binary.AppendUvarint(body, uint64(len(e.Key)))
	body = append(body, e.Key...)
	pairs := 0
	for _, vs := range e.Header {
		pairs += len(vs)
	}
	body = binary.AppendUvarint(body, uint64(pairs))
	for k, vs := range e.Header {
		for _, v := range vs {
			body = binary.AppendUvarint(body, uint64(len(k)))
			body = append(body, k...)
			body = binary.AppendUvarint(body, uint64(len(v)))
			body = append(body, v...)
		}
	}
	body = binary.AppendUvarint(body, uint64(len(e.Data)))
	return append(body, e.Data...)
}

// SetPackHeader writes HeaderPack for n effects into h, replacing it in
// any spelling.
func SetPackHeader(h map[string][]string, n int) {
	deleteNamed(h, isPackHeader)
	h[HeaderPack] = []string{packVersion + " " + strconv.Itoa(n)}
}

// PackCount reads HeaderPack from h: 0 and no error when h carries it in
// no spelling, the count of a packed message, or an error when the header
// is malformed (given more than once, in one spelling or several, or not
// "1 <n>" with n canonical and within 2..MaxPackEffects).
func PackCount(h map[string][]string) (int, error) {
	var v string
	seen := 0
	for k, vs := range h {
		if !isPackHeader(k) {
			continue
		}
		// A name without a value counts: it is malformed too.
		seen += max(len(vs), 1)
		if len(vs) > 0 {
			v = vs[0]
		}
	}
	switch {
	case seen == 0:
		return 0, nil
	case seen > 1:
		return 0, &PackError{Entry: -1, Err: fmt.Errorf("header %s is given more than once", HeaderPack)}
	}
	rest, ok := strings.CutPrefix(v, packVersion+" ")
	if !ok {
		return 0, &PackError{Entry: -1, Err: fmt.Errorf("header %s %q does not start with the version \"1\" and a space", HeaderPack, v)}
	}
	n, err := parseCanonical(rest, MaxPackEffects)
	if err != nil {
		return 0, &PackError{Entry: -1, Err: fmt.Errorf("header %s %q: count: %w", HeaderPack, v, err)}
	}
	if n < 2 {
		return 0, &PackError{Entry: -1, Err: fmt.Errorf("header %s %q counts %d effects: a packed message holds 2 to %d, and one effect goes alone", HeaderPack, v, n, MaxPackEffects)}
	}
	return int(n), nil
}

// isPackHeader reports whether name is HeaderPack in any spelling.
func isPackHeader(name string) bool {
	return len(name) == len(HeaderPack) && strings.EqualFold(name, HeaderPack)
}

// minEntry is the fewest bytes an entry takes: a key of one byte with its
// length, no headers, no data.
const minEntry = 4

// Unpack reads the n effects of a packed body, strictly (see HeaderPack),
// but for what only the message as a whole tells: whether the last key is
// its stamp's. Keys, header names and values are taken from one copy of
// body as a string; data are slices of body. It allocates that string,
// the slice of effects, each effect's header map, and the values' slices
// by chunks.
func Unpack(body []byte, n int) ([]PackedEffect, error) {
	if n < 2 || n > MaxPackEffects {
		return nil, &PackError{Entry: -1, Err: fmt.Errorf("a count of %d effects is outside 2..%d", n, MaxPackEffects)}
	}
	if len(body) < n*minEntry {
		return nil, &PackError{Entry: -1, Err: fmt.Errorf("%d bytes cannot hold %d effects", len(body), n)}
	}
	// One copy for every string of the body: keys, names and values are
	// parts of it.
	s := string(body)
	out := make([]PackedEffect, n)
	// The values of names seen first in an entry share it; a name given
	// again appends to its own.
	var vals []string
	var counts map[string]int
	var seen keySeen
	off := 0
	for i := range out {
		e := &out[i]
		bad := func(err error) ([]PackedEffect, error) { return nil, &PackError{Entry: i, Err: err} }
		var a, b int
		var err error
		if a, b, off, err = field(body, off); err != nil {
			return bad(fmt.Errorf("key: %w", err))
		}
		e.Key = s[a:b]
		if err := validKey(e.Key); err != nil {
			return bad(err)
		}
		if j, ok := seen.add(e.Key, i, out[:i]); !ok {
			return bad(fmt.Errorf("key %q is the key of entry %d too: a packed message's effects have distinct keys", e.Key, j))
		}
		pairs, k, err := uvarint(body[off:])
		if err != nil {
			return bad(fmt.Errorf("header count: %w", err))
		}
		off += k
		// A pair takes at least three bytes: a name of one byte with its
		// length, and the length of its value.
		if pairs > uint64(len(body)-off)/3 {
			return bad(fmt.Errorf("%d headers cannot fit in the %d bytes left", pairs, len(body)-off))
		}
		if pairs > fewPairs {
			if off, err = unpackMany(body, s, off, pairs, e, &vals, &counts); err != nil {
				return bad(err)
			}
		} else if pairs > 0 {
			e.Header = make(map[string][]string, pairs)
			for p := uint64(0); p < pairs; p++ {
				if a, b, off, err = field(body, off); err != nil {
					return bad(fmt.Errorf("header %d name: %w", p, err))
				}
				name := s[a:b]
				if err := packHeaderName(name); err != nil {
					return bad(fmt.Errorf("header %q: %w", name, err))
				}
				if a, b, off, err = field(body, off); err != nil {
					return bad(fmt.Errorf("header %s value: %w", name, err))
				}
				if vs, ok := e.Header[name]; ok {
					e.Header[name] = append(vs, s[a:b])
					continue
				}
				if len(vals) == cap(vals) {
					vals = make([]string, 0, max(pairs-p, uint64(2*(n-i))))
				}
				vals = append(vals, s[a:b])
				e.Header[name] = vals[len(vals)-1 : len(vals) : len(vals)]
			}
		}
		if a, b, off, err = field(body, off); err != nil {
			return bad(fmt.Errorf("data: %w", err))
		}
		e.Data = body[a:b:b]
	}
	if off != len(body) {
		return nil, &PackError{Entry: -1, Err: fmt.Errorf("%d bytes follow the last of its %d effects", len(body)-off, n)}
	}
	return out, nil
}

// fewPairs is how many header pairs an entry may have before Unpack
// counts each name's values first (unpackMany).
const fewPairs = 8

// unpackMany reads the pairs of an entry that has more than fewPairs from
// body at off into e.Header, and returns the offset after them. It reads
// them twice: first to check them and count each name's values, then to
// fill, so that each name's values take a slice of exactly their number,
// cut from one chunk (*vals), where appending them one at a time would
// cost about twice their room again in slices grown and dropped: a forged
// pack of one name given hundreds of thousands of values allocated 38
// times its size. counts is a scratch map kept across entries.
func unpackMany(body []byte, s string, off int, pairs uint64, e *PackedEffect, vals *[]string, counts *map[string]int) (int, error) {
	if *counts == nil {
		*counts = make(map[string]int, fewPairs)
	} else {
		clear(*counts)
	}
	start := off
	var a, b int
	var err error
	for p := uint64(0); p < pairs; p++ {
		if a, b, off, err = field(body, off); err != nil {
			return 0, fmt.Errorf("header %d name: %w", p, err)
		}
		name := s[a:b]
		if err := packHeaderName(name); err != nil {
			return 0, fmt.Errorf("header %q: %w", name, err)
		}
		if _, _, off, err = field(body, off); err != nil {
			return 0, fmt.Errorf("header %s value: %w", name, err)
		}
		(*counts)[name]++
	}
	if cap(*vals)-len(*vals) < int(pairs) {
		*vals = make([]string, 0, pairs)
	}
	e.Header = make(map[string][]string, len(*counts))
	off = start
	for p := uint64(0); p < pairs; p++ {
		// Checked above: these cannot fail.
		a, b, off, _ = field(body, off)
		name := s[a:b]
		a, b, off, _ = field(body, off)
		vs, ok := e.Header[name]
		if !ok {
			n := len(*vals)
			c := (*counts)[name]
			*vals = (*vals)[:n+c]
			vs = (*vals)[n : n : n+c]
		}
		e.Header[name] = append(vs, s[a:b])
	}
	return off, nil
}

// keySeen tells whether a pack's keys are distinct: by a look at each
// key before it while they are few, through a map once they are many, so
// that a pack of MaxPackEffects costs no more than a few times one of a
// few.
type keySeen struct {
	m map[string]int
}

// keySearch is how many keys are searched one by one.
const keySearch = 16

// add notes key, of entry i, after the entries before; it returns the
// entry that has the key already, and false, if there is one.
func (s *keySeen) add(key string, i int, before []PackedEffect) (int, bool) {
	if s.m == nil && i < keySearch {
		for j := range before {
			if before[j].Key == key {
				return j, false
			}
		}
		return 0, true
	}
	if s.m == nil {
		s.m = make(map[string]int, 2*keySearch)
		for j := range before {
			s.m[before[j].Key] = j
		}
	}
	if j, ok := s.m[key]; ok {
		return j, false
	}
	s.m[key] = i
	return 0, true
}

// field reads a length-prefixed field of body at off: its bounds, and the
// offset after it.
func field(body []byte, off int) (int, int, int, error) {
	l, k, err := uvarint(body[off:])
	if err != nil {
		return 0, 0, 0, err
	}
	off += k
	if l > uint64(len(body)-off) {
		return 0, 0, 0, fmt.Errorf("its length %d runs past the end of the body (%d bytes left)", l, len(body)-off)
	}
	return off, off + int(l), off + int(l), nil
}

// uvarint reads a uvarint in its shortest form.
func uvarint(b []byte) (uint64, int, error) {
	v, k := binary.Uvarint(b)
	switch {
	case k == 0:
		return 0, 0, errors.New("the body ends within a length")
	case k < 0:
		return 0, 0, errors.New("a length overflows 64 bits")
	case k != uvarintLen(v):
		return 0, 0, errors.New("a length is not in its shortest form")
	}
	return v, k, nil
}

// uvarintLen is how many bytes binary.AppendUvarint writes for v.
func uvarintLen(v uint64) int { return (bits.Len64(v|1) + 6) / 7 }

// packHeaderName reports whether name can be a header of a packed effect:
// a valid header field name (RFC 9110 token) that is not leasehold's to
// write on the message (see HeaderPack) nor in the Nats- namespace.
func packHeaderName(name string) error {
	if name == "" {
		return errors.New("the name is empty")
	}
	for i := 0; i < len(name); i++ {
		if !isTokenByte(name[i]) {
			return fmt.Errorf("the name holds the byte %#x: header names are tokens (RFC 9110)", name[i])
		}
	}
	const nats = "Nats-"
	switch {
	case IsStampHeader(name), isPackHeader(name), len(name) == len(HeaderBarrier) && strings.EqualFold(name, HeaderBarrier):
		return errors.New("is leasehold's: the stamp, the job mark, the pack and a barrier are the message's, never an effect's in it")
	case len(name) >= len(nats) && strings.EqualFold(name[:len(nats)], nats):
		return errors.New("is in the server's Nats- namespace")
	}
	return nil
}

func isTokenByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}
