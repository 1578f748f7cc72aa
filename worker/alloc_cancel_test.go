package worker

import (
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// cancelUpdate is a cancel record as the watch of the bucket hands it
// over.
type cancelUpdate struct {
	key string
	val []byte
	rev uint64
	op  jetstream.KeyValueOp
}

func (u cancelUpdate) Bucket() string                  { return "jobs-cancels" }
func (u cancelUpdate) Key() string                     { return u.key }
func (u cancelUpdate) Value() []byte                   { return u.val }
func (u cancelUpdate) Revision() uint64                { return u.rev }
func (u cancelUpdate) Created() time.Time              { return time.Time{} }
func (u cancelUpdate) Delta() uint64                   { return 0 }
func (u cancelUpdate) Operation() jetstream.KeyValueOp { return u.op }

func testCancels(p leasehold.Partition) *cancels {
	r := &runner{w: &Worker{cfg: Config{Prefix: "jobs"}}, p: p, log: slog.New(slog.DiscardHandler)}
	return newCancels(r, nil, nil)
}

func putCancel(t *testing.T, c *cancels, key string, rec cancelRecord, rev uint64) {
	t.Helper()
	b, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	c.update(cancelUpdate{key: key, val: b, rev: rev, op: jetstream.KeyValuePut})
}

// A runner looks every job up in its partition's cancels, several times
// an attempt, and nearly every job has none: the look-up finds the jobs
// cancelled by sequence and by ID, and formats no key, hashes no ID and
// allocates nothing for the others.
func TestCancelLookupAllocatesNothingForJobsWithout(t *testing.T) {
	const p = leasehold.Partition(3)
	c := testCancels(p)
	stored := time.Unix(1700000000, 0).UTC()
	due := time.Unix(1700000600, 0).UTC()
	putCancel(t, c, cancelSeqKey(p, 5), cancelRecord{Ref: "r", Partition: uint32(p), Seq: 5, Stored: stored}, 1)
	putCancel(t, c, cancelIDKey(p, "order-7"), cancelRecord{Ref: "r", ID: "order-7", Due: due.Unix(), Partition: uint32(p)}, 2)

	bySeq := &Job{Partition: p, Seq: 5, Enqueued: stored, Header: nats.Header{}}
	byID := &Job{Partition: p, Seq: 40, ID: "order-7", Enqueued: due, Header: nats.Header{
		jetstream.MsgIDHeader: {"order-7"}, hdrScheduler: {ScheduleSubject("jobs", "order-7")}, HeaderDue: {due.Format(time.RFC3339)},
	}}
	other := &Job{Partition: p, Seq: 6, ID: "order-8", Enqueued: stored, Header: nats.Header{jetstream.MsgIDHeader: {"order-8"}}}
	if !c.has(bySeq) || !c.has(byID) || c.has(other) {
		t.Fatalf("cancelled: by sequence %v, by ID %v, another job %v; want true, true, false", c.has(bySeq), c.has(byID), c.has(other))
	}
	if k, _, _ := c.of(byID); k != cancelIDKey(p, "order-7") {
		t.Fatalf("the ID cancel's key is %q", k)
	}
	if n := testing.AllocsPerRun(100, func() { _ = c.has(other) }); n != 0 {
		t.Errorf("looking up a job without a cancel made %v allocations, want 0", n)
	}

	// Deleted by an operator: the jobs are not cancelled any more.
	c.update(cancelUpdate{key: cancelSeqKey(p, 5), rev: 3, op: jetstream.KeyValueDelete})
	c.update(cancelUpdate{key: cancelIDKey(p, "order-7"), rev: 4, op: jetstream.KeyValuePurge})
	if c.has(bySeq) || c.has(byID) || len(c.bySeq) != 0 || len(c.byID) != 0 {
		t.Fatalf("after the deletes: cancelled by sequence %v, by ID %v, %d and %d keys indexed", c.has(bySeq), c.has(byID), len(c.bySeq), len(c.byID))
	}
	if n := testing.AllocsPerRun(100, func() { _ = c.has(byID) }); n != 0 {
		t.Errorf("looking up a job in an empty set of cancels made %v allocations, want 0", n)
	}
}

// A runner reads its partition's cancels when it starts while the
// worker's watch already brings it changes: one key's changes can come
// out of order, and the latest revision stands, a deletion's too.
func TestCancelChangesOutOfOrder(t *testing.T) {
	const p = leasehold.Partition(2)
	stored := time.Unix(1700000000, 0).UTC()
	job := &Job{Partition: p, Seq: 9, Enqueued: stored, Header: nats.Header{}}
	rec := cancelRecord{Ref: "r", Partition: uint32(p), Seq: 9, Stored: stored}
	key := cancelSeqKey(p, 9)

	// Deleted (revision 6) before the read brought the record (5).
	c := testCancels(p)
	c.update(cancelUpdate{key: key, rev: 6, op: jetstream.KeyValueDelete})
	putCancel(t, c, key, rec, 5)
	if c.has(job) {
		t.Fatal("a record older than its deletion cancels the job")
	}
	// Stored again after the deletion: it counts.
	putCancel(t, c, key, rec, 7)
	if !c.has(job) {
		t.Fatal("a record stored after its deletion does not cancel the job")
	}
	// The same record twice, and an older one after it: nothing changes.
	putCancel(t, c, key, rec, 7)
	c.update(cancelUpdate{key: key, rev: 6, op: jetstream.KeyValueDelete})
	if !c.has(job) {
		t.Fatal("an older deletion undid a later record")
	}
	if _, e, _ := c.of(job); e.rev != 7 {
		t.Fatalf("the record's revision is %d, want 7", e.rev)
	}
}
