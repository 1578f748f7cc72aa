package coordinator

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/leasehold/leasehold"
)

// A member advertises the partitions it holds in its own registration, so
// that the others can compute the shared assignment from the member
// records alone and need not watch every partition record: at 65,536
// partitions over 64 members, delivering every acquisition to every member
// was 4.2 million watch deliveries for one cold start, more than the
// members and the server could process in the time the start should take.
// Watching the member records costs a delivery per registration write per
// member, whatever the partition count.
//
// The list is advisory, like the rest of a worker's view: an acquisition is
// a compare-and-set the server checks, and a taker that finds a partition
// held anyway learns it from the refusal. A holder writes its list after
// each change has been stored (a release's purge before the list without
// the partition), so a list never names a partition as free before it is.
//
// The encoding is the ascending partition numbers, the first as is and each
// next as its distance from the one before, as unsigned varints, in
// unpadded base64 (URL alphabet): about 1.4 bytes a partition at 1024
// partitions a member.

// encodeHolds encodes the partitions ps, in ascending order and distinct.
func encodeHolds(ps []leasehold.Partition) string {
	buf := make([]byte, 0, len(ps)*2)
	prev := uint64(0)
	for i, p := range ps {
		d := uint64(p)
		if i > 0 {
			d -= prev
		}
		buf = binary.AppendUvarint(buf, d)
		prev = uint64(p)
	}
	return base64.RawURLEncoding.EncodeToString(buf)
}

// errHolds is the cause of every holdings list that does not decode.
var errHolds = errors.New("coordinator: the member record's holdings do not decode")

// decodeHolds decodes a list encodeHolds wrote for a group of n partitions.
// It checks what it reads, as it comes from the network: ascending,
// distinct, below n, and no longer than n partitions.
func decodeHolds(s string, n int) ([]int32, error) {
	if len(s) > base64.RawURLEncoding.EncodedLen(n*binary.MaxVarintLen32) {
		return nil, fmt.Errorf("%w: %d characters, more than %d partitions can take", errHolds, len(s), n)
	}
	buf, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errHolds, err)
	}
	var out []int32
	prev := uint64(0)
	for i := 0; len(buf) > 0; i++ {
		d, k := binary.Uvarint(buf)
		if k <= 0 {
			return nil, fmt.Errorf("%w: a number that does not end", errHolds)
		}
		buf = buf[k:]
		if i > 0 && d == 0 {
			return nil, fmt.Errorf("%w: partition %d twice", errHolds, prev)
		}
		p := prev + d
		if i == 0 {
			p = d
		}
		if d >= uint64(n) || p >= uint64(n) {
			return nil, fmt.Errorf("%w: a partition beyond the group's %d", errHolds, n)
		}
		out = append(out, int32(p))
		prev = p
	}
	return out, nil
}

// heldList is the partitions of held, in ascending order.
func heldList(held map[leasehold.Partition]*Lease) []leasehold.Partition {
	out := make([]leasehold.Partition, 0, len(held))
	for p := range held {
		out = append(out, p)
	}
	slices.Sort(out)
	return out
}
