package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
)

// legacyProgress is the progress record an earlier leasehold kept in the
// lease bucket under progress.<p>.
type legacyProgress struct {
	Epoch  uint64 `json:"epoch"`
	Seq    uint64 `json:"seq"`
	Holder string `json:"holder"`
}

// movedPrefix starts the value that replaces a moved progress record. It
// is not JSON, so an earlier worker that reads it fails to acquire the
// partition or to commit, loudly, rather than starting the partition's
// progress again from nothing in a record nobody reads.
const movedPrefix = "leasehold: progress moved to the fence-record bucket "

func movedValue(fences string) []byte {
	return []byte(movedPrefix + fences + "; a worker that reads this predates it: upgrade it")
}

func isMoved(data []byte) bool { return strings.HasPrefix(string(data), movedPrefix) }

// migrator moves progress records out of one lease bucket.
type migrator struct {
	js          jetstream.JetStream
	bucket      string
	fences      string
	leader      *leader.Reader
	fenceLeader *leader.Reader
}

// moveProgress copies every progress record lease bucket bucket holds into
// fence-record bucket fences and replaces it with movedValue. Each record
// is copied unless the fence record is as new already (by epoch, then by
// sequence), and replaced by a compare-and-set on the revision that was
// copied, so two Provisions running at once, or an earlier worker
// committing meanwhile, cannot lose progress: whoever loses a race reads
// again.
func moveProgress(ctx context.Context, js jetstream.JetStream, bucket, fences string) (int, error) {
	m := &migrator{js: js, bucket: bucket, fences: fences,
		leader: leader.NewReader(js, "KV_"+bucket), fenceLeader: leader.NewReader(js, "KV_"+fences)}
	prefix := "$KV." + bucket + "." + progressKeyPrefix
	type rec struct {
		p    leasehold.Partition
		rev  uint64
		data []byte
	}
	var todo []rec
	err := scanLast(ctx, js, "KV_"+bucket, prefix+">", func(s scanned) error {
		if s.marker || isMoved(s.data) {
			return nil
		}
		p, err := leasehold.ParsePartition(strings.TrimPrefix(s.subject, prefix))
		if err != nil {
			return nil // not a key leasehold wrote; Findings reports it
		}
		todo = append(todo, rec{p, s.seq, s.data})
		return nil
	})
	if err != nil {
		return 0, err
	}
	for _, r := range todo {
		if err := m.moveOne(ctx, r.p, r.rev, r.data); err != nil {
			return 0, err
		}
	}
	return len(todo), nil
}

// moveOne moves partition p's progress record, whose revision is rev.
func (m *migrator) moveOne(ctx context.Context, p leasehold.Partition, rev uint64, data []byte) error {
	key := progressKeyPrefix + p.String()
	for range 8 {
		var old legacyProgress
		if err := json.Unmarshal(data, &old); err != nil {
			return fmt.Errorf("%w: lease bucket %s: %s (revision %d) is not a progress record (%v), so partition %d's progress is not known: fix it (its seq is the last input handled) or remove it, then upgrade",
				ErrBucketConfig, m.bucket, key, rev, err, p)
		}
		if err := m.copy(ctx, p, old); err != nil {
			return err
		}
		_, err := m.js.PublishMsg(ctx, &nats.Msg{Subject: "$KV." + m.bucket + "." + key, Data: movedValue(m.fences)},
			jetstream.WithExpectLastSequencePerSubject(rev))
		if err == nil {
			return nil
		}
		if !isConflict(err) {
			return fmt.Errorf("coordinator: move %s of lease bucket %s: %w", key, m.bucket, err)
		}
		// Moved by another Provision, or committed to by an earlier
		// worker since it was read: read it again.
		e, err := lastOf(ctx, m.leader, "$KV."+m.bucket+"."+key)
		if err != nil {
			return fmt.Errorf("coordinator: move %s of lease bucket %s: %w", key, m.bucket, err)
		}
		if e.kind != entryValue || isMoved(e.data) {
			return nil
		}
		rev, data = e.rev, e.data
	}
	return fmt.Errorf("coordinator: move %s of lease bucket %s: it kept changing; stop the workers of the earlier leasehold and try again", key, m.bucket)
}

// copy writes old into partition p's fence record unless the record is as
// new already.
func (m *migrator) copy(ctx context.Context, p leasehold.Partition, old legacyProgress) error {
	key := partitionKey(p)
	subject := "$KV." + m.fences + "." + key
	for range 8 {
		e, err := lastOf(ctx, m.fenceLeader, subject)
		if err != nil {
			return fmt.Errorf("coordinator: move progress of partition %d: %w", p, err)
		}
		var expect uint64
		switch e.kind {
		case entryValue:
			cur, err := decodeFence(e.data)
			if err != nil {
				return fmt.Errorf("coordinator: move progress of partition %d: %w: key %s of bucket %s: %s", p, err, key, m.fences, fenceFix(key))
			}
			newer := old.Epoch > cur.Epoch || (old.Epoch == cur.Epoch && cur.Acquisition == "" && old.Seq > cur.Seq)
			if !newer {
				return nil
			}
			expect = e.rev
		case entryMarker:
			expect = e.rev
		}
		r := fenceRecord{Epoch: old.Epoch, Seq: old.Seq, Holder: old.Holder}
		if old.Epoch != 0 {
			r.Recent = []uint64{old.Epoch}
		}
		value, _ := json.Marshal(r)
		_, err = m.js.Publish(ctx, subject, value, jetstream.WithExpectLastSequencePerSubject(expect))
		if err == nil {
			return nil
		}
		if !isConflict(err) {
			return fmt.Errorf("coordinator: move progress of partition %d: %w", p, err)
		}
	}
	return fmt.Errorf("coordinator: move progress of partition %d: its fence record kept changing; try again", p)
}
