package leasehold

import (
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
)

// HeaderOrderKey is on a job: the digest of the key its producer picked
// the partition by. A partition that runs several jobs at once runs the
// jobs of one order key one after another, in stream order, and jobs of
// different keys side by side. The key itself may be long, binary or
// private, so the header carries 16 lowercase hex digits of its FNV-1a
// 64-bit hash (OrderKey); two keys that share a digest are merely kept in
// order with each other.
//
// A job without the header (enqueued by a release before, to a partition
// by number with no key, or published by hand) is ordered by partition: it
// waits for every earlier job of its partition, and no later job starts
// before it. So does a job whose header does not parse.
const HeaderOrderKey = "Leasehold-Order-Key"

// orderKeyLen is the length of a HeaderOrderKey value.
const orderKeyLen = 16

// OrderKey is the HeaderOrderKey value of the jobs enqueued with partition
// key key: 16 lowercase hex digits of its FNV-1a 64-bit hash.
func OrderKey(key []byte) string {
	h := fnv.New64a()
	_, _ = h.Write(key)
	return formatOrderKey(h.Sum64())
}

func formatOrderKey(v uint64) string {
	const digits = "0123456789abcdef"
	var b [orderKeyLen]byte
	for i := orderKeyLen - 1; i >= 0; i-- {
		b[i] = digits[v&0xf]
		v >>= 4
	}
	return string(b[:])
}

// ErrBadOrderKey is matched by the error of an order key that does not
// parse.
var ErrBadOrderKey = errors.New("leasehold: malformed order key")

// ParseOrderKey reads a HeaderOrderKey value, strictly: exactly 16
// lowercase hex digits. It returns the digest.
func ParseOrderKey(s string) (uint64, error) {
	if len(s) != orderKeyLen {
		return 0, fmt.Errorf("%w: %d bytes, not %d lowercase hex digits", ErrBadOrderKey, len(s), orderKeyLen)
	}
	var v uint64
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c -= 'a' - 10
		default:
			return 0, fmt.Errorf("%w: %q is not a lowercase hex digit", ErrBadOrderKey, s[i])
		}
		v = v<<4 | uint64(c)
	}
	return v, nil
}

// OrderKeyFromHeader reads a job's order key: ok is false when the job has
// none. The name matches without regard to case; a header given twice
// with different values, or a value that does not parse, is an error
// matching ErrBadOrderKey. A job with an error is ordered by partition.
func OrderKeyFromHeader(h map[string][]string) (key uint64, ok bool, err error) {
	var val string
	for k, vs := range h {
		if len(k) != len(HeaderOrderKey) || !strings.EqualFold(k, HeaderOrderKey) {
			continue
		}
		for _, v := range vs {
			if ok && v != val {
				return 0, false, fmt.Errorf("%w: header %s given twice, as %.32q and %.32q", ErrBadOrderKey, HeaderOrderKey, val, v)
			}
			val, ok = v, true
		}
	}
	if !ok {
		return 0, false, nil
	}
	if key, err = ParseOrderKey(val); err != nil {
		return 0, false, fmt.Errorf("header %s %.32q: %w", HeaderOrderKey, val, err)
	}
	return key, true, nil
}
