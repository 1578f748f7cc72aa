package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/fleet"
	"github.com/leasehold/leasehold/internal/history"
	"github.com/leasehold/leasehold/telemetry"
	"github.com/leasehold/leasehold/worker"
)

// produce enqueues the jobs evenly over the first half of the run.
func (d *demo) produce(ctx context.Context, js jetstream.JetStream, prefix string, tel telemetry.Config) {
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: prefix, Partitions: d.cfg.partitions, Telemetry: tel})
	if err != nil {
		d.note("producer: %v", err)
		return
	}
	every := d.cfg.duration / 2 / time.Duration(d.cfg.jobs)
	tick := time.NewTicker(max(every, time.Millisecond))
	defer tick.Stop()
	for i := range d.cfg.jobs {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		e, err := p.Enqueue(ctx, []byte(fmt.Sprintf("order-%d", i)), []byte(fmt.Sprintf(`{"order":%d}`, i)))
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			d.note("enqueue failed: %v", err)
			continue
		}
		d.mu.Lock()
		d.enqueued[leasehold.EffectKey(prefix, e.Partition, e.Seq, 0)] = demoJob{e.Partition, e.Seq}
		d.perPart[e.Partition] = append(d.perPart[e.Partition], e.Seq)
		d.mu.Unlock()
	}
}

// freeze pauses the worker that holds the most partitions for TTL + 2s,
// then resumes it. It picks the moment: a pause that lands between jobs
// makes no zombie write, so it pauses, reads the worker's history, and
// keeps the pause only if some handler of the worker is in the middle of
// a job (it took its stamp and has not written yet).
func (d *demo) freeze(ctx context.Context, b *coordinator.Bucket, procs map[string]*fleet.Proc, histDir string) error {
	var victim string
	var st coordinator.Status
	for try := 0; ; try++ {
		var err error
		if st, err = b.Snapshot(ctx); err != nil {
			return err
		}
		victim = mostPartitions(st, procs)
		if err := procs[victim].Pause(); err != nil {
			return err
		}
		if try >= 100 || midJob(filepath.Join(histDir, victim+".jsonl")) {
			break
		}
		_ = procs[victim].Resume()
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			return nil
		}
	}
	var held []leasehold.Partition
	pause := d.cfg.ttl + 2*time.Second
	d.mu.Lock()
	for _, p := range st.Partitions {
		if p.Holder == victim {
			d.pausedEpoch[p.Partition] = p.Epoch
			held = append(held, p.Partition)
		}
	}
	d.paused, d.pauses, d.pausedAt, d.pausedParts = victim, d.pauses+1, time.Now(), held
	d.mu.Unlock()
	d.note("FROZE %s (SIGSTOP) in the middle of a job; it holds partitions %v and cannot renew for %v", victim, held, pause)
	sleepCtx(ctx, pause)
	if err := procs[victim].Resume(); err != nil {
		return err
	}
	d.mu.Lock()
	d.paused = ""
	d.mu.Unlock()
	d.note("RESUMED %s (SIGCONT): it wakes up mid-job, not knowing its leases expired, and writes with its old epochs", victim)
	return nil
}

func mostPartitions(st coordinator.Status, procs map[string]*fleet.Proc) string {
	held := map[string]int{}
	for _, p := range st.Partitions {
		held[p.Holder]++
	}
	victim := ""
	for name := range procs {
		if victim == "" || held[name] > held[victim] || (held[name] == held[victim] && name < victim) {
			victim = name
		}
	}
	return victim
}

// midJob reports whether the worker's history ends, for some partition,
// with a handler that took its stamp and has not written yet.
func midJob(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	open := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var e history.Event
		if json.Unmarshal(sc.Bytes(), &e) != nil {
			continue
		}
		switch e.Kind {
		case history.Start:
			open[e.Key] = true
		case history.Effect:
			delete(open, e.Key)
		case history.Lose, history.Release:
			clear(open)
		}
	}
	return len(open) > 0
}
