package streamsink

import (
	"encoding/base64"
	"encoding/json"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A chain's floor and the jobs applied above it, by the rules of chains.go:
// a final with a floor adds its job and raises the floor to its own, a
// final without one raises the floor to its job, and what the floor passes
// leaves the set.
func TestChainFloorAndSet(t *testing.T) {
	gs := newGroups()
	c := chainKey{fence: leasehold.FenceID{Scope: "s", Partition: 0}, subject: "s.out.0"}
	k := func(job uint64) groupKey { return groupKey{chainKey: c, epoch: 3, acquisition: "a3", job: job} }
	floored := func(floor uint64) leasehold.JobMark {
		return leasehold.JobMark{Effects: 1, Floor: floor, Floored: true}
	}
	steps := []struct {
		job   uint64
		final leasehold.JobMark
		floor uint64
		above []uint64
	}{
		{4, floored(0), 0, []uint64{4}},
		{2, floored(0), 0, []uint64{2, 4}},
		{7, floored(1), 1, []uint64{2, 4, 7}},
		{3, floored(2), 2, []uint64{3, 4, 7}},
		{5, floored(4), 4, []uint64{5, 7}},
		{6, floored(5), 5, []uint64{6, 7}},
		{9, floored(7), 7, []uint64{9}},
		{8, leasehold.JobMark{Effects: 1}, 8, []uint64{9}}, // a sequential final: the floor is its job
		{10, leasehold.JobMark{Effects: 1}, 10, nil},
	}
	for _, s := range steps {
		ch := gs.chain(k(s.job))
		if ch.done(s.job) {
			t.Fatalf("job %d is settled before it applies: %+v", s.job, ch)
		}
		gs.advance(k(s.job), ch, s.final, 1, false, true)
		got := gs.chain(k(s.job))
		if got.Floor != s.floor || !slices.Equal(got.Above, s.above) {
			t.Fatalf("after job %d: floor %d, above %v; want %d, %v", s.job, got.Floor, got.Above, s.floor, s.above)
		}
		if gs.above != len(s.above) {
			t.Errorf("after job %d the runner counts %d jobs above floors, want %d", s.job, gs.above, len(s.above))
		}
	}
	ch := gs.chain(k(11))
	for job := uint64(1); job <= 10; job++ {
		if !ch.done(job) || !ch.holds(job) {
			t.Errorf("job %d is not settled on %+v", job, ch)
		}
	}
	if ch.done(11) || ch.holds(11) || !ch.holds(0) {
		t.Errorf("job 11 settled, or After 0 not holding, on %+v", ch)
	}
	// Another lease of the chain starts from nothing.
	if other := gs.chain(groupKey{chainKey: c, epoch: 4, acquisition: "a4", job: 1}); other.done(1) || other.Floor != 0 || len(other.Above) != 0 {
		t.Errorf("a later lease sees %+v", other)
	}
	// Past maxAbove the runner stops before it delivers.
	defer func(n int) { maxAbove = n }(maxAbove)
	maxAbove = 2
	for job := uint64(20); job < 23; job++ {
		gs.advance(k(job), gs.chain(k(job)), floored(10), 1, false, true)
	}
	if gs.overflow == nil {
		t.Errorf("3 jobs above the floor with a bound of 2: no error")
	}
}

// The jobs above a floor are saved as uvarint deltas in URL base64, and
// read back strictly: what anyone with access to the state bucket writes
// there is checked.
func TestAboveEncoding(t *testing.T) {
	for _, c := range []struct {
		floor uint64
		above []uint64
	}{
		{0, nil}, {0, []uint64{1}}, {7, []uint64{9, 10, 300, 1 << 40}}, {1<<63 - 2, []uint64{1<<63 - 1, 1 << 63}},
	} {
		s := encodeAbove(c.floor, c.above)
		got, err := decodeAbove(c.floor, s)
		if err != nil || !slices.Equal(got, c.above) {
			t.Errorf("floor %d, above %v: encoded %q, read back %v, %v", c.floor, c.above, s, got, err)
		}
	}
	enc := func(b ...byte) string { return base64.RawURLEncoding.EncodeToString(b) }
	for _, bad := range []string{
		enc(0),          // a delta of 0: a job twice, or the floor itself
		enc(0x81, 0x00), // 1 written in two bytes
		enc(0x80),       // cut short
		enc(0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01), // past 2^63
		base64.URLEncoding.EncodeToString([]byte{1, 2}),                 // padded
		"!!",
	} {
		if got, err := decodeAbove(5, bad); err == nil {
			t.Errorf("decodeAbove(5, %q) = %v, want an error", bad, got)
		}
	}
	defer func(n int) { maxAbove = n }(maxAbove)
	maxAbove = 3
	if _, err := decodeAbove(0, enc(1, 1, 1, 1)); err == nil {
		t.Error("4 jobs read with a bound of 3")
	}
}

// An applied shard a runner before floors wrote (its last applied job in
// "j", no "x") reads as that job's floor with nothing above it; and what a
// sequential chain writes now is that same format, which such a runner
// reads.
func TestAppliedShardOfEarlierFormat(t *testing.T) {
	const before = `{"applied":[{"s":"old","p":0,"sub":"old.out.0","e":3,"a":"a3","j":7,"h":[5]}]}`
	var v appliedValue
	if err := json.Unmarshal([]byte(before), &v); err != nil {
		t.Fatal(err)
	}
	e := v.Applied[0]
	if err := e.validate(); err != nil {
		t.Fatal(err)
	}
	a := e.applied()
	if a.Floor != 7 || len(a.Above) != 0 || !slices.Equal(a.Holes, []uint64{5}) {
		t.Fatalf("read as %+v, want floor 7 with hole 5 and nothing above", a)
	}
	for job := uint64(1); job <= 8; job++ {
		if a.done(job) != (job <= 7) {
			t.Errorf("job %d settled: %v", job, a.done(job))
		}
	}
	again, err := json.Marshal(appliedValue{Applied: []appliedEntry{entryOf(e.chain(), a)}})
	if err != nil || string(again) != before {
		t.Errorf("written back as %s, %v; want %s", again, err, before)
	}
	// Jobs above the floor, and dead-lettered jobs among them.
	a.Above, a.Holes = []uint64{9, 12}, []uint64{5, 12}
	out := entryOf(e.chain(), a)
	if err := out.validate(); err != nil || !slices.Equal(out.applied().Above, a.Above) {
		t.Errorf("%+v: %v", out, err)
	}
	out.Holes = []uint64{10}
	if err := out.validate(); err == nil {
		t.Errorf("a dead-lettered job neither below the floor nor above it accepted: %+v", out)
	}
	for _, bad := range []appliedEntry{
		{Scope: "old", Subject: "old.out.0", Epoch: 3, Job: 0},              // nothing applied
		{Scope: "old", Subject: "old.out.0", Epoch: 3, Job: 7, Above: "AA"}, // a delta of 0
		{Scope: "old", Subject: "old.out.0", Epoch: 3, Job: 0, Above: "AQ", Holes: []uint64{2}},
	} {
		if err := bad.validate(); err == nil {
			t.Errorf("entry %+v accepted", bad)
		}
	}
	if ok := (appliedEntry{Scope: "old", Subject: "old.out.0", Epoch: 3, Job: 0, Above: "AQ"}); ok.validate() != nil {
		t.Errorf("floor 0 with job 1 above it refused: %v", ok.validate())
	}
}

// A runner started on a shard of the earlier format takes the jobs up to
// its last job for duplicates and applies the next one.
func TestRunnerReadsAppliedShardOfEarlierFormat(t *testing.T) {
	srv := natstest.Start(t)
	js := srv.JetStream(t)
	ctx := testCtx(t, time.Minute)
	cfg := Config{Prefix: "old", Provision: true, Logger: slog.New(slog.DiscardHandler)}
	r, err := New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	id := leasehold.FenceID{Scope: "old", Partition: 0}
	before := `{"applied":[{"s":"old","p":0,"sub":"old.out.0","e":3,"a":"a3","j":7}]}`
	if _, err := r.stateKV.Put(ctx, r.appliedKey(appliedShard(id)), []byte(before)); err != nil {
		t.Fatal(err)
	}
	again, err := New(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	a := again.groups.chain(groupKey{chainKey: chainKey{fence: id, subject: "old.out.0"}, epoch: 3, acquisition: "a3"})
	if a.Floor != 7 || len(a.Above) != 0 {
		t.Fatalf("loaded %+v, want floor 7", a)
	}
	if again.groups.above != 0 {
		t.Errorf("counts %d jobs above floors", again.groups.above)
	}
}
