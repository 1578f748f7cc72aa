package kvsink

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/leasehold/leasehold"
)

// The sink's own keys, beside the effects', all under internalPrefix:
//
//	_leasehold.fence.<scope token>.<partition>   the fence of one FenceID
//	_leasehold.dedupe.<sha256 hex>               one applied (scope, key)
//
// and, in buckets written before fence scopes (see Config.LegacyScope):
//
//	_leasehold.fence.<partition>                 a fence with no scope
//	_leasehold.key.<sha256 hex of the key>       an applied key with no scope
//
// The two layouts never share a key: a scoped fence key has one token more
// than a legacy one, and the dedupe keys live under different names.

// Prefix of the sink's own keys in the bucket. Effect subjects must not
// start with it.
const internalPrefix = "_leasehold."

const (
	fencePrefix        = internalPrefix + "fence."
	dedupePrefix       = internalPrefix + "dedupe."
	legacyDedupePrefix = internalPrefix + "key."
)

// scopeEscape starts an escaped byte in a scope token.
const scopeEscape = '='

// plainScopeByte reports whether c stands for itself in a scope token.
// Every other byte is written as '=' and two upper-case hex digits: '.'
// (it separates KV key tokens), '=' (it is the escape), and every byte a
// KV key may not hold (':', '*', '>', '~', '@' and the rest of printable
// ASCII). '/' stays, since keys may hold it and lock scopes are full of it.
func plainScopeByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '/'
}

// scopeToken encodes a scope as one KV key token. The encoding is
// reversible (see parseScopeToken), so two scopes never share a token,
// and it leaves the scopes of job streams (letters, digits, '-', '_') as
// they are. A scope of MaxScopeLen bytes that all need escaping takes
// 3*MaxScopeLen bytes.
func scopeToken(scope string) string {
	n := 0
	for i := 0; i < len(scope); i++ {
		if !plainScopeByte(scope[i]) {
			n++
		}
	}
	if n == 0 {
		return scope
	}
	const digits = "0123456789ABCDEF"
	b := make([]byte, 0, len(scope)+2*n)
	for i := 0; i < len(scope); i++ {
		c := scope[i]
		if plainScopeByte(c) {
			b = append(b, c)
			continue
		}
		b = append(b, scopeEscape, digits[c>>4], digits[c&0xf])
	}
	return string(b)
}

// parseScopeToken is the inverse of scopeToken. It accepts only what
// scopeToken writes: upper-case hex, and escapes only where they are
// needed, so that each scope has exactly one token.
func parseScopeToken(tok string) (string, error) {
	if tok == "" {
		return "", errors.New("empty scope token")
	}
	var b strings.Builder
	b.Grow(len(tok))
	for i := 0; i < len(tok); i++ {
		c := tok[i]
		switch {
		case plainScopeByte(c):
			b.WriteByte(c)
		case c == scopeEscape:
			if i+2 >= len(tok) {
				return "", fmt.Errorf("scope token %q ends inside an escape", tok)
			}
			v, err := hex.DecodeString(tok[i+1 : i+3])
			if err != nil || strings.ToUpper(tok[i+1:i+3]) != tok[i+1:i+3] {
				return "", fmt.Errorf("scope token %q: %q is not an escape of two upper-case hex digits", tok, tok[i:i+3])
			}
			if plainScopeByte(v[0]) {
				return "", fmt.Errorf("scope token %q escapes %q, which stands for itself", tok, v[0])
			}
			b.WriteByte(v[0])
			i += 2
		default:
			return "", fmt.Errorf("scope token %q holds %q", tok, c)
		}
	}
	return b.String(), nil
}

// fenceKey is the key of fence id's record.
func fenceKey(id leasehold.FenceID) string {
	tok := scopeToken(id.Scope)
	b := make([]byte, 0, len(fencePrefix)+len(tok)+6)
	b = append(b, fencePrefix...)
	b = append(b, tok...)
	b = append(b, '.')
	b = append(b, id.Partition.String()...)
	return string(b)
}

// legacyFenceKey is the key of partition p's fence in a bucket written
// before fence scopes.
func legacyFenceKey(p leasehold.Partition) string { return fencePrefix + p.String() }

// MaxFenceKeyLen is the length of the longest fence key: a scope of
// leasehold.MaxScopeLen bytes that all need escaping, and the highest
// partition. With "$KV.<bucket>." in front it must fit the server's
// control line (4096 bytes by default), which it does with room to spare.
const MaxFenceKeyLen = len(fencePrefix) + 3*leasehold.MaxScopeLen + len(".65535")

// dedupeSep separates scope and key in the hashed dedupe name. Neither a
// scope nor an idempotency key may hold it (both refuse control bytes), so
// the hashed string splits back into one (scope, key) only.
const dedupeSep = 0

// dedupeKey is the key that records that (scope, key) was applied.
func dedupeKey(scope, key string) string { return dedupeName(dedupeValue(scope, key)) }

// dedupeValue is a dedupe key's value: the bytes its name is the hash of.
func dedupeValue(scope, key string) []byte {
	b := make([]byte, 0, len(scope)+1+len(key))
	b = append(b, scope...)
	b = append(b, dedupeSep)
	return append(b, key...)
}

// dedupeName is the name of the dedupe key whose value is v.
func dedupeName(v []byte) string {
	sum := sha256.Sum256(v)
	b := make([]byte, len(dedupePrefix), len(dedupePrefix)+2*sha256.Size)
	copy(b, dedupePrefix)
	return string(hex.AppendEncode(b, sum[:]))
}

// legacyDedupeKey is the key that recorded key as applied in a bucket
// written before fence scopes.
func legacyDedupeKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	return legacyDedupePrefix + hex.EncodeToString(sum[:])
}

// validKey mirrors the KV key rules: letters, digits and -/_=., with no
// empty token.
func validKey(k string) bool {
	if k == "" || k[0] == '.' || k[len(k)-1] == '.' || strings.Contains(k, "..") {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("-/_=.", c) >= 0) {
			return false
		}
	}
	return true
}

// ErrBadSubject is matched by the error for an effect whose subject is
// not a key the sink can write.
var ErrBadSubject = errors.New("kvsink: effect subject is not a usable key")

// CheckKey returns an error matching ErrBadSubject when key cannot be an
// effect's subject (its KV key), and nil when it can.
func CheckKey(key string) error {
	if !validKey(key) {
		return fmt.Errorf("%w: %q: use letters, digits and -/_=. (dot-separated, no empty part)", ErrBadSubject, key)
	}
	if strings.HasPrefix(key, internalPrefix) {
		return fmt.Errorf("%w: %q: keys starting with %s are the sink's own", ErrBadSubject, key, internalPrefix)
	}
	return nil
}
