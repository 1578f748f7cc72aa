package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/leasehold/leasehold/testing/natstest"
)

// A fence record keeps the last FenceHistory acquisitions as (epoch,
// acquisition) pairs, ascending with its own last, and names the newest
// epoch it dropped.
func TestFenceRecordHistory(t *testing.T) {
	t.Parallel()
	var r fenceRecord
	for i := range FenceHistory + 3 {
		r = r.withEpoch(uint64(100+10*i), fmt.Sprintf("a%d", i), "w")
	}
	if len(r.Recent) != FenceHistory || len(r.Acquisitions) != FenceHistory {
		t.Fatalf("record keeps %d epochs and %d acquisitions, want %d each", len(r.Recent), len(r.Acquisitions), FenceHistory)
	}
	last := FenceHistory + 2
	if r.Epoch != uint64(100+10*last) || r.Acquisition != fmt.Sprintf("a%d", last) || r.Recent[FenceHistory-1] != r.Epoch || r.Acquisitions[FenceHistory-1] != r.Acquisition {
		t.Fatalf("record %+v does not end with its own acquisition", r)
	}
	if r.Recent[0] != 130 || r.Acquisitions[0] != "a3" || r.Forgotten != 120 {
		t.Fatalf("oldest kept %d (%s), forgotten %d; want 130 (a3), 120", r.Recent[0], r.Acquisitions[0], r.Forgotten)
	}
	if !slices.IsSorted(r.Recent) {
		t.Fatalf("recent epochs not ascending: %v", r.Recent)
	}
	// It survives its JSON.
	data, _ := json.Marshal(r)
	back, err := decodeFence(data)
	if err != nil || !slices.Equal(back.history(), r.history()) || back.Forgotten != r.Forgotten {
		t.Fatalf("decoded %+v, %v; want %+v", back, err, r)
	}
}

// A record of the release before (epochs only) keeps its epochs, with no
// acquisition (verified by epoch alone), when a new acquisition fences it;
// its own acquisition is known from the record's Acquisition. One that
// holds as many epochs as that release kept may have forgotten older ones.
func TestFenceRecordFromPreviousRelease(t *testing.T) {
	t.Parallel()
	prev, err := decodeFence([]byte(`{"epoch":40,"acquisition":"a40","seq":7,"holder":"w","recent":[10,20,30,40]}`))
	if err != nil {
		t.Fatal(err)
	}
	want := []fencedBy{{10, ""}, {20, ""}, {30, ""}, {40, "a40"}}
	if got := prev.history(); !slices.Equal(got, want) {
		t.Fatalf("history %v, want %v", got, want)
	}
	if prev.forgotten() != 0 {
		t.Fatalf("a short record forgot %d", prev.forgotten())
	}
	next := prev.withEpoch(50, "a50", "v")
	if !slices.Equal(next.Recent, []uint64{10, 20, 30, 40, 50}) || !slices.Equal(next.Acquisitions, []string{"", "", "", "a40", "a50"}) || next.Seq != 7 {
		t.Fatalf("rewritten %+v", next)
	}
	full, err := decodeFence([]byte(`{"epoch":80,"acquisition":"a80","holder":"w","recent":[10,20,30,40,50,60,70,80]}`))
	if err != nil {
		t.Fatal(err)
	}
	if full.forgotten() != 9 || full.withEpoch(90, "a90", "w").Forgotten != 9 {
		t.Fatalf("a full record of the release before: forgotten %d, want 9", full.forgotten())
	}
	// Acquisitions that do not line up with the epochs are garbage.
	if _, err := decodeFence([]byte(`{"epoch":20,"acquisition":"b","holder":"w","recent":[10,20],"acquisitions":["b"]}`)); !errors.Is(err, errGarbledFence) {
		t.Fatalf("misaligned acquisitions: %v, want a garbled record", err)
	}
}

// What a fence record costs by the size of its history: its JSON, with
// the epochs (Unix microseconds) and tokens acquisitions have.
func TestFenceRecordSize(t *testing.T) {
	t.Parallel()
	for _, n := range []int{8, 16, 32} {
		var r fenceRecord
		for i := range n {
			r = r.withEpoch(uint64(1_796_520_000_000_000+i*1_000_003), newToken(), "worker-0123456789")
		}
		r.Seq = 123456
		if n < len(r.Recent) {
			r.Recent, r.Acquisitions = r.Recent[len(r.Recent)-n:], r.Acquisitions[len(r.Acquisitions)-n:]
		}
		data, _ := json.Marshal(r)
		epochsOnly := r
		epochsOnly.Acquisitions = nil
		old, _ := json.Marshal(epochsOnly)
		t.Logf("history %2d: %5d bytes (epochs only: %4d)", n, len(data), len(old))
	}
}

// BenchmarkFenceRecordWrite measures one compare-and-set write of a fence
// record by the size of its history, as an acquisition writes it, on one
// embedded server with the default sync and with sync_interval: always.
//
//	go test ./coordinator -run '^$' -bench FenceRecordWrite -count 5
func BenchmarkFenceRecordWrite(b *testing.B) {
	for _, sync := range []string{"default", "always"} {
		for _, n := range []int{8, 16, 32} {
			b.Run(fmt.Sprintf("sync=%s/history=%d", sync, n), func(b *testing.B) {
				var opts []natstest.Option
				if sync == "always" {
					opts = append(opts, natstest.SyncAlways())
				}
				js := natstest.Start(b, opts...).JetStream(b)
				ctx := context.Background()
				bucket, err := Provision(ctx, js, BucketConfig{})
				if err != nil {
					b.Fatal(err)
				}
				var r fenceRecord
				for i := range n {
					r = r.withEpoch(uint64(1_796_520_000_000_000+i*1_000_003), newToken(), "worker-0123456789")
				}
				data, _ := json.Marshal(r)
				var rev uint64
				for b.Loop() {
					if rev, err = bucket.putFence(ctx, "partition.1", r, rev); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(len(data)), "bytes/record")
				b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/write")
			})
		}
	}
}
