package worker_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/worker"
)

// 10,000 jobs over 16 partitions and 3 workers; a 4th joins and one
// leaves while jobs flow. Every job runs, in order within each epoch, every
// effect carries the epoch of the lease its job ran under (as the
// coordinator handed it out), no job is lost, and no job that a lease
// committed runs again.
func TestTenThousandJobsWhileWorkersComeAndGo(t *testing.T) {
	const (
		n     = 16
		total = 10000
	)
	e := newEnv(t, n)
	var runs runLog
	rec := newRecorder()
	h := worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
		runs.add(j)
		return j.Emit(ctx, j.Data)
	})
	workers := map[string]*running{}
	startWorker := func(name string) {
		cfg := e.config(name, h)
		cfg.Coordinator.TTL = 5 * time.Second
		cfg.Observer = rec
		workers[name] = start(t, cfg)
	}
	for _, name := range []string{"w1", "w2", "w3"} {
		startWorker(name)
	}

	// Enqueue at a steady pace for the whole run, so that hand-offs happen
	// with jobs in flight.
	var wg sync.WaitGroup
	var enq []worker.Enqueued
	var enqErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; i < total && enqErr == nil; i += 250 {
			var got []worker.Enqueued
			got, enqErr = e.tryEnqueue(i, 250)
			enq = append(enq, got...)
			time.Sleep(25 * time.Millisecond)
		}
	}()

	// One deadline for the whole run, not one per step: each step waits
	// on events, and on a loaded machine a step may take minutes while
	// the run as a whole still makes progress.
	deadline := time.Now().Add(8 * time.Minute)
	if d, ok := t.Deadline(); ok && d.Add(-30*time.Second).Before(deadline) {
		deadline = d.Add(-30 * time.Second)
	}
	left := func() time.Duration { return time.Until(deadline) }
	rec.waitFor(t, left(), "a third of the jobs", func() bool { return runs.n.Load() >= total/3 })
	startWorker("w4")
	rec.waitFor(t, left(), "w4 to take partitions", func() bool { return len(workers["w4"].w.Held()) >= n/4 })
	rec.waitFor(t, left(), "two thirds of the jobs", func() bool { return runs.n.Load() >= 2*total/3 })
	workers["w2"].stop(t)
	wg.Wait()
	if enqErr != nil {
		t.Fatal(enqErr)
	}
	if len(enq) != total {
		t.Fatalf("enqueued %d jobs, want %d", len(enq), total)
	}
	type job struct {
		p   leasehold.Partition
		seq uint64
	}
	done := func() bool {
		seen := map[job]bool{}
		for _, r := range runs.all() {
			seen[job{r.P, r.Seq}] = true
		}
		for _, q := range enq {
			if !seen[job{q.Partition, q.Seq}] {
				return false
			}
		}
		return true
	}
	rec.waitFor(t, left(), "every job to run", done)
	for name, w := range workers {
		if name != "w2" {
			w.stop(t)
		}
	}

	// The epochs the coordinator handed out, per partition, and who got
	// them.
	holder := map[leasehold.Partition]map[leasehold.Epoch]string{}
	for _, ev := range rec.all() {
		if ev.Kind == worker.EventPartitionAcquired {
			if holder[ev.Lease.Partition] == nil {
				holder[ev.Lease.Partition] = map[leasehold.Epoch]string{}
			}
			holder[ev.Lease.Partition][ev.Lease.Epoch] = ev.Lease.Holder
		}
	}
	lost := rec.count(kind(worker.EventPartitionLost))
	if lost > 0 {
		t.Logf("%d leases were lost during the run (a slow machine); jobs may have run twice", lost)
	}

	// Order within each epoch, and each run under an epoch handed out to
	// the worker that ran it.
	type pe struct {
		p leasehold.Partition
		e leasehold.Epoch
	}
	last := map[pe]uint64{}
	ranUnder := map[job]map[leasehold.Epoch]bool{}
	count := map[job]int{}
	for _, r := range runs.all() {
		if got := holder[r.P][r.Epoch]; got != r.Worker {
			t.Fatalf("job %d of partition %d ran on %s under epoch %d, which was handed to %q", r.Seq, r.P, r.Worker, r.Epoch, got)
		}
		// Every job has a key of its own: only a partition that runs one
		// job at a time runs them in stream order (see TestKeyOrder for
		// the order of keys).
		k := pe{r.P, r.Epoch}
		if r.Seq <= last[k] && testPartitionConcurrency == 1 {
			t.Fatalf("partition %d epoch %d: job %d ran after job %d", r.P, r.Epoch, r.Seq, last[k])
		}
		last[k] = max(last[k], r.Seq)
		j := job{r.P, r.Seq}
		if ranUnder[j] == nil {
			ranUnder[j] = map[leasehold.Epoch]bool{}
		}
		ranUnder[j][r.Epoch] = true
		count[j]++
	}
	if lost == 0 {
		for j, c := range count {
			if c != 1 {
				t.Errorf("job %d of partition %d ran %d times, though every hand-off was graceful", j.seq, j.p, c)
			}
		}
	}

	// A job runs again only while no lease has committed it. A worker
	// whose lease is lost after a job's effect is stored, but before a
	// commit covers the job, leaves the job to its successor, which runs
	// it again under its own epoch (a rewind runs it again under the same
	// one): its effect is then stored once per run, each under a
	// Nats-Msg-Id of its own (MessageID), with the same key, and a sink
	// that dedupes by key applies it once (I5). So a load that loses
	// leases stores effects more than once, and that is no fault. What
	// must never happen is a run after a commit that covers the job: a
	// committed job's effect would be made again (I4, I8). A commit under
	// epoch e succeeded before any later epoch was acquired, so no later
	// epoch may run a job that e committed; within an epoch, a commit
	// covers only done jobs and a rewind runs only jobs not done, so no
	// attempt of a job starts after its lease committed it (the runner
	// records the commit before it starts anything after it).
	commits := map[pe][]coordinator.Committed{}
	epochs := map[leasehold.Partition][]leasehold.Epoch{}
	committed := func(p leasehold.Partition, e leasehold.Epoch, seq uint64) bool {
		for _, c := range commits[pe{p, e}] {
			if c.Includes(seq) {
				return true
			}
		}
		return false
	}
	for _, ev := range rec.all() {
		p, e := ev.Lease.Partition, ev.Lease.Epoch
		switch ev.Kind {
		case worker.EventProgressCommitted:
			if len(commits[pe{p, e}]) == 0 {
				epochs[p] = append(epochs[p], e)
			}
			done := ev.Done[:min(len(ev.Done), coordinator.MaxDone)]
			commits[pe{p, e}] = append(commits[pe{p, e}], coordinator.Committed{Epoch: e, Seq: ev.Seq, Done: done})
		case worker.EventJobStarted:
			if committed(p, e, ev.Seq) {
				t.Errorf("job %d of partition %d started (attempt %d) under epoch %d after that epoch committed it", ev.Seq, p, ev.Attempt, e)
			}
		}
	}
	for _, r := range runs.all() {
		for _, e := range epochs[r.P] {
			if e < r.Epoch && committed(r.P, e, r.Seq) {
				t.Errorf("job %d of partition %d ran on %s under epoch %d, though epoch %d had committed it", r.Seq, r.P, r.Worker, r.Epoch, e)
			}
		}
	}

	data := map[job]string{}
	for _, r := range runs.all() {
		data[job{r.P, r.Seq}] = r.Data
	}
	type runOf struct {
		job
		e leasehold.Epoch
	}
	runsUnder := map[runOf]int{}
	for _, r := range runs.all() {
		runsUnder[runOf{job{r.P, r.Seq}, r.Epoch}]++
	}
	// Every effect: stamped with an epoch its job ran under, on its
	// partition's output, never behind a barrier of a later epoch, and
	// stored at most once per run of its job under that epoch.
	stored := map[runOf]int{}
	again := 0 // effects stored again, for jobs that ran again
	effects := map[job]bool{}
	maxEpoch := map[leasehold.Partition]leasehold.Epoch{}
	barriers := map[pe]int{}  // barriers in the log, by the lease that wrote them
	unfenced := map[pe]bool{} // leases with an effect before their barrier
	for _, m := range readStream(t, e.js, worker.EffectsStream(e.prefix)) {
		s := stampOf(t, m)
		if m.Subject() != worker.OutputSubject(e.prefix, s.Partition) {
			t.Fatalf("effect %s of partition %d on subject %s", s.Key, s.Partition, m.Subject())
		}
		if holder[s.Partition][s.Epoch] == "" {
			t.Fatalf("message %s carries epoch %d, which was never handed out for partition %d", s.Key, s.Epoch, s.Partition)
		}
		if s.Epoch < maxEpoch[s.Partition] {
			t.Errorf("effect %s of epoch %d follows a message of epoch %d: a graceful hand-off let the old holder write late", s.Key, s.Epoch, maxEpoch[s.Partition])
		}
		maxEpoch[s.Partition] = max(maxEpoch[s.Partition], s.Epoch)
		if isBarrier(m) {
			barriers[pe{s.Partition, s.Epoch}]++
			if s.Key != leasehold.BarrierKey(e.prefix, s.Partition, s.Epoch) {
				t.Fatalf("barrier key %s", s.Key)
			}
			continue
		}
		if k := (pe{s.Partition, s.Epoch}); barriers[k] == 0 && !unfenced[k] {
			unfenced[k] = true
			t.Errorf("effect %s of epoch %d precedes its epoch's barrier on partition %d", s.Key, s.Epoch, s.Partition)
		}
		seq := seqOfKey(t, e.prefix, s)
		j := job{s.Partition, seq}
		if !ranUnder[j][s.Epoch] {
			t.Fatalf("effect %s carries epoch %d, but its job never ran under that epoch", s.Key, s.Epoch)
		}
		// A job that ran again (see above) has its effect stored again,
		// under the same key.
		stored[runOf{j, s.Epoch}]++
		if n, ran := stored[runOf{j, s.Epoch}], runsUnder[runOf{j, s.Epoch}]; n > ran {
			t.Fatalf("effect %s of epoch %d stored %d times, but its job ran %d times under that epoch", s.Key, s.Epoch, n, ran)
		}
		if effects[j] {
			again++
		}
		effects[j] = true
		if string(m.Data()) != data[j] {
			t.Fatalf("effect %s holds %q", s.Key, m.Data())
		}
	}
	for _, q := range enq {
		if !effects[job{q.Partition, q.Seq}] {
			t.Fatalf("job %d of partition %d has no effect", q.Seq, q.Partition)
		}
	}
	// Every runner that went on to handle jobs wrote its barrier first
	// (above: no effect precedes its epoch's barrier), and every barrier
	// is a lease's that was handed out (above: its epoch has a holder). A
	// lease revoked before its runner started (the assignment moved while
	// the acquisition ran, or the worker was leaving) writes none, and
	// handles nothing. A barrier is also in the log without its lease
	// being made ready when the publish failed though the message was
	// stored (its acknowledgement lost, the lease lost while it was
	// awaited): the runner retries under a new message ID, or gives the
	// partition up. So ready <= leases with a barrier <= acquisitions,
	// and, when no lease was lost, every barrier is one lease's, made
	// ready.
	acquisitions := rec.count(kind(worker.EventPartitionAcquired))
	ready := 0
	for _, ev := range rec.all() {
		if ev.Kind != worker.EventPartitionReady {
			continue
		}
		ready++
		if barriers[pe{ev.Lease.Partition, ev.Lease.Epoch}] == 0 {
			t.Errorf("partition %d was made ready under epoch %d, which has no barrier in the log", ev.Lease.Partition, ev.Lease.Epoch)
		}
	}
	written := 0 // barrier messages
	for _, c := range barriers {
		written += c
	}
	if ready > len(barriers) || len(barriers) > acquisitions {
		t.Errorf("%d partitions made ready, %d leases with a barrier (%d barriers), %d acquisitions: want ready <= leases with a barrier <= acquisitions", ready, len(barriers), written, acquisitions)
	}
	if lost == 0 && (written != ready || len(barriers) != ready) {
		t.Errorf("%d barriers of %d leases for %d partitions made ready (%d acquisitions), though no lease was lost", written, len(barriers), ready, acquisitions)
	}
	t.Logf("%d jobs, %d effects (%d stored again by jobs that ran again), %d acquisitions, %d leases lost", len(enq), len(effects), again, acquisitions, lost)
}

// seqOfKey reads the job sequence out of an effect's idempotency key.
func seqOfKey(t testing.TB, prefix string, s leasehold.Stamp) uint64 {
	t.Helper()
	parts := strings.Split(strings.TrimPrefix(s.Key, prefix+"."), ".")
	if len(parts) != 3 || parts[0] != s.Partition.String() {
		t.Fatalf("effect key %q is not %s.<partition>.<seq>.<index>", s.Key, prefix)
	}
	seq, err := strconv.ParseUint(parts[1], 10, 64)
	if err != nil {
		t.Fatalf("effect key %q: %v", s.Key, err)
	}
	return seq
}
