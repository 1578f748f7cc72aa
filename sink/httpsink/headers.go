package httpsink

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/leasehold/leasehold"
)

// Header names a relayed request carries beside the effect's stamp
// (leasehold.HeaderScope and the others) and W3C trace context.
const (
	// HeaderIdempotencyKey is the IETF Idempotency-Key header
	// (draft-ietf-httpapi-idempotency-key-header): a Structured Field
	// String, IdempotencyKey(stamp).
	HeaderIdempotencyKey = "Idempotency-Key"
	// HeaderRelayScope, HeaderRelayEpoch and HeaderRelayAcquisition are
	// the relay's own stamp: the scope of its lock
	// ("<lease bucket scope>/<lock name>"), the lock's epoch and the
	// acquisition that issued it. The lock's partition is always 0.
	HeaderRelayScope       = "Leasehold-Relay-Scope"
	HeaderRelayEpoch       = "Leasehold-Relay-Epoch"
	HeaderRelayAcquisition = "Leasehold-Relay-Acquisition"
	// HeaderRelayWorker names the relay's process, for messages; never
	// trusted.
	HeaderRelayWorker = "Leasehold-Relay-Worker"
	// HeaderSubject is the effect's subject in the effect log, so that one
	// receiver can tell effects of several kinds apart. Informative.
	HeaderSubject = "Leasehold-Subject"
	// HeaderReplayed is set to "true" on a Verifier's answer to a repeated
	// idempotency key: the handler did not run, and the status is the
	// first request's.
	HeaderReplayed = "Idempotent-Replayed"
)

// maxKeyHeader bounds an Idempotency-Key value: the longest the relay
// writes is a scope (256 bytes), a space, a key of 256 bytes each written
// as three, and the quotes and escapes.
const maxKeyHeader = 2 * (leasehold.MaxScopeLen + 1 + 3*leasehold.MaxKeyLen + 2)

// IdempotencyKey is the Idempotency-Key value of an effect stamped s: a
// Structured Field String (RFC 8941) holding the stamp's scope, a space
// and its idempotency key. Dedupe in leasehold is per scope and key (two
// job streams may use one key), and a scope holds no space, so the value
// names one effect and the scope can be read back from it. Bytes of the
// key outside printable ASCII, and '%', are written as '%' and two
// upper-case hex digits, so that the value is ASCII; '"' and '\' are
// escaped as the Structured Field syntax says. For the keys workers
// derive (leasehold.EffectKey) the value is "<scope> <scope>.<p>.<seq>.<n>"
// in quotes.
func IdempotencyKey(s leasehold.Stamp) string {
	return quoteKey(keyText(s.Scope, s.Key))
}

// keyText is the text an Idempotency-Key holds for scope and key, before
// quoting.
func keyText(scope, key string) string {
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	b.Grow(len(scope) + 1 + len(key))
	b.WriteString(scope)
	b.WriteByte(' ')
	for i := 0; i < len(key); i++ {
		c := key[i]
		if c < 0x21 || c > 0x7e || c == '%' {
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&15])
			continue
		}
		b.WriteByte(c)
	}
	return b.String()
}

// quoteKey writes t, printable ASCII, as a Structured Field String.
func quoteKey(t string) string {
	var b strings.Builder
	b.Grow(len(t) + 4)
	b.WriteByte('"')
	for i := 0; i < len(t); i++ {
		if c := t[i]; c == '"' || c == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(t[i])
	}
	b.WriteByte('"')
	return b.String()
}

// ErrBadKey is matched by the errors of ParseIdempotencyKey.
var ErrBadKey = errors.New("httpsink: malformed Idempotency-Key")

// ParseIdempotencyKey reads an Idempotency-Key value strictly: one
// Structured Field String (RFC 8941, section 3.3.3) and nothing else, no
// parameters, at most a bounded length. It returns the string's content.
func ParseIdempotencyKey(v string) (string, error) {
	bad := func(why string) (string, error) { return "", fmt.Errorf("%w: %s", ErrBadKey, why) }
	switch {
	case v == "":
		return bad("it is empty")
	case len(v) > maxKeyHeader:
		return bad(fmt.Sprintf("it is %d bytes long; the limit is %d", len(v), maxKeyHeader))
	case len(v) < 2 || v[0] != '"' || v[len(v)-1] != '"':
		return bad("it is not a quoted string (RFC 8941 sf-string)")
	}
	var b strings.Builder
	b.Grow(len(v))
	for i := 1; i < len(v)-1; i++ {
		c := v[i]
		switch {
		case c == '\\':
			if i+1 >= len(v)-1 || (v[i+1] != '"' && v[i+1] != '\\') {
				return bad("a backslash escapes only '\"' or '\\'")
			}
			i++
			b.WriteByte(v[i])
		case c == '"':
			return bad("an unescaped '\"' inside the string")
		case c < 0x20 || c > 0x7e:
			return bad(fmt.Sprintf("it holds the byte %#x: only printable ASCII", c))
		default:
			b.WriteByte(c)
		}
	}
	if b.Len() == 0 {
		return bad("the string is empty")
	}
	return b.String(), nil
}

// SetStamp writes a direct request's stamp into h: the effect's stamp
// headers and its Idempotency-Key. A client that calls a receiver itself
// (with a stamp from worker.Job.NextStamp, say) uses it; a Verifier judges
// such a request against the fence of the stamp's own scope and
// partition.
func SetStamp(h http.Header, s leasehold.Stamp) {
	s.SetHeader(h)
	h.Set(HeaderIdempotencyKey, IdempotencyKey(s))
}

// SetRelayHeader writes the relay's lease l (a lock's) into h.
func SetRelayHeader(h http.Header, l leasehold.Lease) {
	h.Set(HeaderRelayScope, l.Scope)
	h.Set(HeaderRelayEpoch, l.Epoch.String())
	h.Set(HeaderRelayAcquisition, l.Acquisition)
	if l.Holder != "" && printable(l.Holder, 128) {
		h.Set(HeaderRelayWorker, l.Holder)
	} else {
		h.Del(HeaderRelayWorker)
	}
}

// ErrBadRelay is matched by the errors of RelayFromHeader.
var ErrBadRelay = errors.New("httpsink: malformed relay stamp")

// RelayFromHeader reads a relay's stamp from request headers, strictly:
// each header once, parsed with the root package's parsers (canonical
// decimal epochs, valid scopes and acquisition tokens). ok is false when
// the request carries none of the relay headers; a request that carries
// some but not all, or a malformed one, is an error matching ErrBadRelay.
// The partition of the lease returned is 0, a lock's.
func RelayFromHeader(h http.Header) (l leasehold.Lease, ok bool, err error) {
	scope, n1, err1 := one(h, HeaderRelayScope)
	epoch, n2, err2 := one(h, HeaderRelayEpoch)
	acq, n3, err3 := one(h, HeaderRelayAcquisition)
	worker, _, err4 := one(h, HeaderRelayWorker)
	if n1+n2+n3 == 0 {
		if err4 == nil && worker != "" {
			return leasehold.Lease{}, false, fmt.Errorf("%w: %s without %s", ErrBadRelay, HeaderRelayWorker, HeaderRelayScope)
		}
		return leasehold.Lease{}, false, nil
	}
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return leasehold.Lease{}, false, fmt.Errorf("%w: %w", ErrBadRelay, err)
	}
	for name, n := range map[string]int{HeaderRelayScope: n1, HeaderRelayEpoch: n2, HeaderRelayAcquisition: n3} {
		if n == 0 {
			return leasehold.Lease{}, false, fmt.Errorf("%w: %s is missing", ErrBadRelay, name)
		}
	}
	if err := leasehold.ValidateScope(scope); err != nil {
		return leasehold.Lease{}, false, fmt.Errorf("%w: %s: %w", ErrBadRelay, HeaderRelayScope, err)
	}
	e, err := leasehold.ParseEpoch(epoch)
	if err != nil {
		return leasehold.Lease{}, false, fmt.Errorf("%w: %s: %w", ErrBadRelay, HeaderRelayEpoch, err)
	}
	if err := leasehold.ValidateAcquisition(acq); err != nil {
		return leasehold.Lease{}, false, fmt.Errorf("%w: %s: %w", ErrBadRelay, HeaderRelayAcquisition, err)
	}
	if worker != "" && !printable(worker, 128) {
		return leasehold.Lease{}, false, fmt.Errorf("%w: %s must be printable ASCII, at most 128 bytes", ErrBadRelay, HeaderRelayWorker)
	}
	return leasehold.Lease{Scope: scope, Epoch: e, Acquisition: acq, Holder: worker}, true, nil
}

// one returns the single value of header name, matched without regard to
// case; n is how many values it has (a second is an error, even if equal:
// a request is not to say one thing twice).
func one(h http.Header, name string) (v string, n int, err error) {
	for k, vs := range h {
		if !strings.EqualFold(k, name) {
			continue
		}
		for _, x := range vs {
			if n == 0 {
				v = x
			}
			n++
		}
	}
	if n > 1 {
		return "", n, fmt.Errorf("header %s is given %d times", name, n)
	}
	return v, n, nil
}

// printable reports whether s is 1 to max bytes of printable ASCII.
func printable(s string, max int) bool {
	if s == "" || len(s) > max {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

type ctxKey int

const (
	stampKey ctxKey = iota
	relayKey
)

// StampFrom returns the stamp of the request a Verifier admitted, from
// the context of the request its handler gets.
func StampFrom(ctx context.Context) (leasehold.Stamp, bool) {
	s, ok := ctx.Value(stampKey).(leasehold.Stamp)
	return s, ok
}

// RelayFrom returns the relay's lease of the request a Verifier admitted,
// when the request came through a relay.
func RelayFrom(ctx context.Context) (leasehold.Lease, bool) {
	l, ok := ctx.Value(relayKey).(leasehold.Lease)
	return l, ok
}
