package coordinator_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// A partition held by a member session is never written again after its
// acquisition: the lease is renewed with its holder's registration. The
// snapshot dates its renewal by the registration's last write, so that a
// healthy partition does not read as renewed minutes ago; and a partition
// whose session is gone shows so.
func TestSnapshotDatesSessionLeasesByTheirSession(t *testing.T) {
	t.Parallel()
	const n = 2
	js, b := startBucket(t)
	ctx := ctxFor(t, time.Minute)
	m := startSessionMember(t, b, "steady", n, 2*time.Second)
	waitFor(t, 30*time.Second, "the member holds both partitions", func() bool { return len(m.c.Held()) == n })
	kv, err := js.KeyValue(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	part, err := kv.Get(ctx, "partition.0")
	if err != nil {
		t.Fatal(err)
	}
	// Two renewals of the registration after the partition was written.
	w, err := kv.Watch(ctx, "member.steady", jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	var renewal jetstream.KeyValueEntry
	for renewals := 0; renewals < 2; {
		select {
		case e := <-w.Updates():
			if e != nil && e.Operation() == jetstream.KeyValuePut {
				renewal, renewals = e, renewals+1
			}
		case <-ctx.Done():
			t.Fatal("the registration was not renewed")
		}
	}
	st, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ps := st.Partitions[0]
	if ps.Session == 0 || ps.SessionEnded || ps.Holder != "steady" {
		t.Fatalf("partition 0: %+v; want held by steady's live session", ps)
	}
	if !ps.Renewed.After(part.Created()) || ps.Renewed.Before(renewal.Created()) {
		t.Errorf("partition 0 renewed at %v: want the registration's last renewal (at or after %v), not the record's write at %v",
			ps.Renewed, renewal.Created(), part.Created())
	}

	// A record naming a session that is not its holder's registration.
	rec := fmt.Sprintf(`{"holder":"ghost","token":"old","ttl_ms":%d,"acquired":"2026-01-01T00:00:00Z","session":12345}`, int64(1)<<41)
	if _, err := kv.Put(ctx, "partition.7", []byte(rec)); err != nil {
		t.Fatal(err)
	}
	st, err = b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range st.Partitions {
		if p.Partition == leasehold.Partition(7) && (!p.SessionEnded || p.Holder != "ghost") {
			t.Errorf("partition 7 under an ended session: %+v; want SessionEnded", p)
		}
	}
}
