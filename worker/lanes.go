package worker

import "container/heap"

// A partition's fetched jobs wait to start in lanes, one FIFO queue per
// order key (order.go): a lane runs one job at a time, and its next job
// starts once the one before has returned and its finals are sent. Of the
// lanes whose head may start, the one with the earliest head goes first,
// so a partition with room for one job runs them in stream order. A job
// ordered by partition (lanePartition) starts only when no job of the
// partition runs and every earlier one has started, and while it runs no
// other job starts. The runner's goroutine alone uses its lanes.

// lanes are a partition's jobs waiting to start.
type lanes struct {
	byKey   map[laneKey]*lane
	ready   laneHeap // lanes not running a job, with jobs waiting, by their head
	running int      // lanes running a job
	queued  int      // jobs waiting
	// partition is set while a job ordered by partition runs.
	partition bool
	// free are emptied lanes, used again: most jobs have a key of their
	// own, and a lane of their own for as long as they wait and run.
	free []*lane
}

// maxFreeLanes bounds the emptied lanes kept for use again.
const maxFreeLanes = 64

// lane is the queue of one order key.
type lane struct {
	key  laneKey
	jobs []*jobRun // waiting, in stream order
	busy bool      // its job runs: the next waits
	at   int       // index in ready; -1 when not in it
	// first holds the jobs of a lane that has one waiting at a time, as
	// most have.
	first [1]*jobRun
}

func newLanes() *lanes { return &lanes{byKey: map[laneKey]*lane{}} }

// push queues j, the partition's furthest job yet, in its lane.
func (ls *lanes) push(j *jobRun) {
	l := ls.byKey[j.lane]
	if l == nil {
		l = ls.newLane(j.lane)
		ls.byKey[j.lane] = l
	}
	l.jobs = append(l.jobs, j)
	ls.queued++
	if !l.busy && l.at < 0 {
		heap.Push(&ls.ready, l)
	}
}

// newLane returns an empty lane of key k, an emptied one if there is one.
func (ls *lanes) newLane(k laneKey) *lane {
	if n := len(ls.free); n > 0 {
		l := ls.free[n-1]
		ls.free[n-1] = nil
		ls.free = ls.free[:n-1]
		l.key = k
		return l
	}
	l := &lane{key: k, at: -1}
	l.jobs = l.first[:0]
	return l
}

// next is the job to start next, or nil when none may start now.
func (ls *lanes) next() *jobRun {
	if ls.partition || len(ls.ready) == 0 {
		return nil
	}
	l := ls.ready[0]
	if l.key.kind == lanePartition && ls.running > 0 {
		// It waits for every earlier job: those still running.
		return nil
	}
	return l.jobs[0]
}

// start takes j, which next returned, off its lane: the lane is busy
// until returned(j).
func (ls *lanes) start(j *jobRun) {
	l := ls.byKey[j.lane]
	heap.Remove(&ls.ready, l.at)
	l.jobs[0] = nil
	l.jobs = l.jobs[1:]
	l.busy = true
	ls.queued--
	ls.running++
	if l.key.kind == lanePartition {
		ls.partition = true
	}
}

// returned frees j's lane: its next job may start.
func (ls *lanes) returned(j *jobRun) {
	l := ls.byKey[j.lane]
	if l == nil || !l.busy {
		return
	}
	l.busy = false
	ls.running--
	if l.key.kind == lanePartition {
		ls.partition = false
	}
	if len(l.jobs) == 0 {
		delete(ls.byKey, l.key)
		if len(ls.free) < maxFreeLanes {
			// Not in ready (it was busy), and no job names it: its
			// jobs name its key, which it gives up here.
			*l = lane{at: -1}
			l.jobs = l.first[:0]
			ls.free = append(ls.free, l)
		}
		return
	}
	heap.Push(&ls.ready, l)
}

// laneHeap orders lanes by the sequence of their first waiting job.
type laneHeap []*lane

func (h laneHeap) Len() int           { return len(h) }
func (h laneHeap) Less(i, j int) bool { return h[i].jobs[0].seq < h[j].jobs[0].seq }
func (h laneHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].at, h[j].at = i, j
}

func (h *laneHeap) Push(x any) {
	l := x.(*lane)
	l.at = len(*h)
	*h = append(*h, l)
}

func (h *laneHeap) Pop() any {
	old := *h
	l := old[len(old)-1]
	old[len(old)-1] = nil
	l.at = -1
	*h = old[:len(old)-1]
	return l
}
