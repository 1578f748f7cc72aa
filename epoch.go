package leasehold

import (
	"fmt"
	"math"
	"strconv"
)

// Epoch is a partition's fencing token: the revision of the lease-bucket
// write that acquired the partition. Epochs of one partition strictly
// increase across acquisitions. The zero Epoch means "none" and is never
// issued.
type Epoch uint64

// MaxEpoch is the largest epoch leasehold accepts. Epochs are stored in
// PostgreSQL bigint columns, so they stay within int64.
const MaxEpoch Epoch = math.MaxInt64

// String formats e as a decimal number.
func (e Epoch) String() string { return strconv.FormatUint(uint64(e), 10) }

// Partition identifies one partition of a job stream: 0 <= p < count.
type Partition uint32

// MaxPartitions is the largest partition count leasehold supports.
const MaxPartitions = 1 << 16

// String formats p as a decimal number.
func (p Partition) String() string { return strconv.FormatUint(uint64(p), 10) }

// ParseEpoch parses the canonical decimal form of an epoch: digits only, no
// sign, no leading zeros, no spaces, between 1 and MaxEpoch.
func ParseEpoch(s string) (Epoch, error) {
	v, err := parseCanonical(s, uint64(MaxEpoch))
	if err != nil {
		return 0, fmt.Errorf("epoch %q: %w", s, err)
	}
	if v == 0 {
		return 0, fmt.Errorf("epoch %q: %w", s, errZero)
	}
	return Epoch(v), nil
}

// ParsePartition parses the canonical decimal form of a partition number:
// digits only, no sign, no leading zeros, below MaxPartitions.
func ParsePartition(s string) (Partition, error) {
	v, err := parseCanonical(s, MaxPartitions-1)
	if err != nil {
		return 0, fmt.Errorf("partition %q: %w", s, err)
	}
	return Partition(v), nil
}

type parseError string

func (e parseError) Error() string { return string(e) }

const (
	errEmpty    parseError = "is empty"
	errNotDigit parseError = "must be decimal digits only (no sign, spaces or other characters)"
	errPadded   parseError = "has a leading zero"
	errTooLarge parseError = "is out of range"
	errZero     parseError = "is zero, and epochs start at 1"
)

// parseCanonical accepts exactly the strings strconv.FormatUint produces for
// values up to max. strconv.ParseUint alone would accept "+1" in some forms
// and "007"; a fencing token must have a single spelling.
func parseCanonical(s string, max uint64) (uint64, error) {
	if s == "" {
		return 0, errEmpty
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, errNotDigit
		}
	}
	if len(s) > 1 && s[0] == '0' {
		return 0, errPadded
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil || v > max {
		return 0, fmt.Errorf("%w (the largest allowed is %d)", errTooLarge, max)
	}
	return v, nil
}
