package worker

import (
	"testing"
)

// Jobs of keys of their own each take a lane while they wait and run: a
// lane emptied is used again, and a partition's lanes allocate nothing
// per job once warm, while they still start the jobs in stream order and
// one at a time per key.
func TestLanesUseEmptiedLanesAgain(t *testing.T) {
	ls := newLanes()
	seq := uint64(0)
	cycle := func() {
		// Three jobs of keys of their own and a fourth of the first's key.
		var js [4]*jobRun
		for i := range js {
			seq++
			js[i] = &jobRun{seq: seq, lane: laneKey{kind: laneKeyed, key: seq}}
		}
		js[3].lane = js[0].lane
		for _, j := range js {
			ls.push(j)
		}
		var started []*jobRun
		for j := ls.next(); j != nil; j = ls.next() {
			ls.start(j)
			started = append(started, j)
		}
		if len(started) != 3 || started[0] != js[0] || started[1] != js[1] || started[2] != js[2] {
			t.Fatalf("started %d jobs, want the first three in stream order", len(started))
		}
		for _, j := range started {
			ls.returned(j)
		}
		if j := ls.next(); j != js[3] {
			t.Fatalf("after its key's job returned, the next job is %v, want the fourth", j)
		}
		ls.start(js[3])
		ls.returned(js[3])
		if ls.queued != 0 || ls.running != 0 || len(ls.byKey) != 0 || len(ls.ready) != 0 {
			t.Fatalf("left: %d queued, %d running, %d lanes, %d ready", ls.queued, ls.running, len(ls.byKey), len(ls.ready))
		}
	}
	cycle()
	if len(ls.free) != 3 {
		t.Fatalf("%d emptied lanes kept, want 3", len(ls.free))
	}
	// The jobs themselves are the fetcher's: only the lanes' work counts.
	runs := make([]*jobRun, 0, 4000)
	for i := range cap(runs) {
		runs = append(runs, &jobRun{seq: uint64(1e6 + i), lane: laneKey{kind: laneKeyed, key: uint64(1e6 + i)}})
	}
	i := 0
	if n := testing.AllocsPerRun(1000, func() {
		j := runs[i]
		i++
		ls.push(j)
		ls.start(ls.next())
		ls.returned(j)
	}); n != 0 {
		t.Errorf("a job through a lane of its own made %v allocations, want 0", n)
	}
}
