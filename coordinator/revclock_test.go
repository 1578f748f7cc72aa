package coordinator

import (
	"testing"
	"time"
)

func TestRevClockDatesRevisionsByTheWatch(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1000, 0)
	c := newRevClock(3 * time.Second)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	c.saw(10, at(0))
	c.saw(20, at(time.Second))
	c.saw(15, at(2*time.Second))                // an earlier revision, seen later: nothing new
	c.saw(21, at(time.Second+time.Millisecond)) // within the spacing of the last sample
	c.saw(30, at(2*time.Second))
	for _, tc := range []struct {
		rev  uint64
		want time.Time
	}{
		{5, at(0)},            // stood since before the first sample
		{10, at(time.Second)}, // the sample at 10 is this record's own write or later
		{19, at(time.Second)}, // below 20
		{25, at(2 * time.Second)},
		{30, at(9 * time.Second)}, // nothing seen after it: now
		{99, at(9 * time.Second)},
	} {
		if got := c.since(tc.rev, at(9*time.Second)); !got.Equal(tc.want) {
			t.Errorf("since(%d) = %v, want %v", tc.rev, got.Sub(t0), tc.want.Sub(t0))
		}
	}
	// Samples older than the horizon go, but for the newest of them, which
	// still proves any earlier revision older than the horizon.
	c.saw(40, at(10*time.Second))
	if n := len(c.samples); n != 2 {
		t.Fatalf("%d samples kept, want 2: %+v", n, c.samples)
	}
	if got := c.since(5, at(10*time.Second)); at(10*time.Second).Sub(got) <= 3*time.Second {
		t.Errorf("since(5) = %v: no longer older than the horizon", got.Sub(t0))
	}
	// Bounded however many writes it sees.
	for i := range 100000 {
		c.saw(uint64(100+i), at(10*time.Second+time.Duration(i)*time.Millisecond))
	}
	if n := len(c.samples); n > 20 {
		t.Errorf("%d samples kept, want at most 20", n)
	}
}

// A write of this process's at a revision the samples already passed says
// the bucket was re-created below them: they are all dropped, and a record
// of the new bucket is dated from now.
func TestRevClockForgetsARecreatedBucket(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1000, 0)
	c := newRevClock(3 * time.Second)
	c.saw(100, t0)
	c.saw(200, t0.Add(time.Second))
	if c.wrote(201, t0.Add(2*time.Second)) {
		t.Fatal("a write above every sample dropped them")
	}
	if c.wrote(150, t0.Add(time.Second/2)) {
		t.Fatal("a write sent before the sample above it dropped the samples")
	}
	if got := c.since(150, t0.Add(10*time.Second)); !got.Equal(t0.Add(time.Second)) {
		t.Fatalf("since(150) = %v, want the sample of revision 200", got)
	}
	if !c.wrote(160, t0.Add(2*time.Second)) {
		t.Fatal("a write below a sample kept the samples")
	}
	now := t0.Add(10 * time.Second)
	if got := c.since(150, now); !got.Equal(now) {
		t.Fatalf("since(150) = %v after the re-creation, want now", got)
	}
}
