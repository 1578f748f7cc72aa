package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// PartitionStatus is what the bucket says about one partition.
type PartitionStatus struct {
	Partition leasehold.Partition `json:"partition"`
	// Holder and Epoch describe the live lease; Holder is "" when the
	// partition is free.
	Holder   string          `json:"holder,omitempty"`
	Epoch    leasehold.Epoch `json:"epoch,omitempty"`
	Acquired time.Time       `json:"acquired,omitzero"`
	Renewed  time.Time       `json:"renewed,omitzero"` // server time of the last write
	TTL      time.Duration   `json:"ttl,omitempty"`
	// FencedEpoch and Progress come from the progress record: the newest
	// epoch that started work on the partition and the last input sequence
	// committed.
	FencedEpoch leasehold.Epoch `json:"fenced_epoch,omitempty"`
	Progress    uint64          `json:"progress"`
}

// Status is a snapshot of the bucket.
type Status struct {
	Partitions []PartitionStatus `json:"partitions"`
	Members    []string          `json:"members"`
}

// Snapshot reads every lease, member and progress record in the bucket. It
// is for display: it reads through direct gets, which a follower may answer.
func (b *Bucket) Snapshot(ctx context.Context) (Status, error) {
	w, err := b.kv.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return Status{}, fmt.Errorf("coordinator: read bucket %s: %w", b.name, err)
	}
	defer w.Stop()
	parts := map[leasehold.Partition]*PartitionStatus{}
	get := func(p leasehold.Partition) *PartitionStatus {
		if parts[p] == nil {
			parts[p] = &PartitionStatus{Partition: p}
		}
		return parts[p]
	}
	var st Status
	for {
		var e jetstream.KeyValueEntry
		select {
		case <-ctx.Done():
			return Status{}, fmt.Errorf("coordinator: read bucket %s: %w", b.name, ctx.Err())
		case e = <-w.Updates():
		}
		if e == nil {
			break
		}
		key := e.Key()
		switch {
		case strings.HasPrefix(key, memberKeyPrefix):
			st.Members = append(st.Members, key[len(memberKeyPrefix):])
		case strings.HasPrefix(key, partitionKeyPrefix):
			p, err := leasehold.ParsePartition(key[len(partitionKeyPrefix):])
			if err != nil {
				continue
			}
			ps := get(p)
			if r, err := decodeRecord(e.Value()); err == nil {
				ps.Holder, ps.Epoch, ps.Acquired = r.Holder, epochOf(r, e.Revision()), r.Acquired
				ps.TTL = time.Duration(r.TTLMilli) * time.Millisecond
			} else {
				ps.Holder = "?"
			}
			ps.Renewed = e.Created()
		case strings.HasPrefix(key, progressKeyPrefix):
			p, err := leasehold.ParsePartition(key[len(progressKeyPrefix):])
			if err != nil {
				continue
			}
			var r progressRecord
			if json.Unmarshal(e.Value(), &r) == nil {
				ps := get(p)
				ps.FencedEpoch, ps.Progress = leasehold.Epoch(r.Epoch), r.Seq
			}
		}
	}
	for _, ps := range parts {
		st.Partitions = append(st.Partitions, *ps)
	}
	slices.SortFunc(st.Partitions, func(a, b PartitionStatus) int { return int(a.Partition) - int(b.Partition) })
	slices.Sort(st.Members)
	return st, nil
}
