package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/fleet"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/worker"
)

// procGroup runs `leasehold worker` processes against one job stream and
// watches what they do: who holds which partition (from the lease bucket)
// and when each partition last produced an effect under a new epoch (from
// the effect subjects).
type procGroup struct {
	e          *env
	prefix     string
	bucket     string
	partitions int
	ttl        time.Duration
	nc         *nats.Conn
	js         jetstream.JetStream
	stops      []func()
	// mode says how start runs a worker: as a process (the default), as
	// a worker in this process, or as the lease layer alone in this
	// process (a coordinator.Run group member, without job consumers).
	mode    runMode
	inStops map[string]func()
	// args are added to every worker process's command line.
	args []string

	mu    sync.Mutex
	procs map[string]*fleet.Proc
	slots []leaseSlot         // by partition, from the lease bucket
	live  map[string]bool     // registered members
	seen  []effectSeen        // by partition, from the effect subjects
	exits map[string]struct{} // processes that exited
}

type leaseSlot struct {
	holder string
	epoch  leasehold.Epoch
}

type effectSeen struct {
	epoch leasehold.Epoch
	at    time.Time // when the first effect at epoch arrived
}

// newProcGroup provisions the job stream and the lease bucket, and starts
// watching them.
func (e *env) newProcGroup(ctx context.Context, prefix string, partitions int, ttl time.Duration) (*procGroup, error) {
	nc, js, err := e.connect("bench group " + prefix)
	if err != nil {
		return nil, err
	}
	g := &procGroup{
		e: e, prefix: prefix, bucket: prefix + "-leases", partitions: partitions, ttl: ttl, nc: nc, js: js,
		procs: map[string]*fleet.Proc{}, slots: make([]leaseSlot, partitions), live: map[string]bool{},
		seen: make([]effectSeen, partitions), exits: map[string]struct{}{},
	}
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: prefix, Partitions: partitions, Replicas: e.replicas()}); err != nil {
		g.close(ctx)
		return nil, fmt.Errorf("provision the job stream: %w", err)
	}
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: g.bucket, MarkerTTL: time.Second, Replicas: e.replicas()})
	if err != nil {
		g.close(ctx)
		return nil, fmt.Errorf("provision the lease bucket: %w", err)
	}
	// A deployment's workers start on streams and buckets that exist: the
	// clock of a cold start starts once these are led and replicated.
	if err := e.waitReplicas(ctx, js, worker.JobsStream(prefix), "KV_"+g.bucket, "KV_"+b.FenceBucket()); err != nil {
		g.close(ctx)
		return nil, err
	}
	// One watcher per filter: the server serves a multi-filter consumer by
	// matching every subject in the bucket for every message.
	for _, filter := range []string{"partition.>", "member.>"} {
		// A request that times out once on a cluster still busy with
		// the rows before (R3, every write synced) must not cost the
		// whole row: set-up requests are retried, within a bound. The
		// watch lives as long as the context it is given, so it gets
		// the group's, not the attempt's, which ends when the attempt
		// returns; its creation is bounded by the client's own timeout.
		var w jetstream.KeyWatcher
		err := retry.Default.Do(ctx, func(context.Context) error {
			var err error
			w, err = b.KeyValue().Watch(ctx, filter)
			return err
		})
		if err != nil {
			g.close(ctx)
			return nil, fmt.Errorf("watch the lease bucket's %s: %w", filter, err)
		}
		g.stops = append(g.stops, e.goRun(ctx, func(ctx context.Context) {
			defer func() {
				// Take what is still coming until nats.go closes the
				// channel: its delivery goroutine may be blocked on it.
				_ = w.Stop()
				for range w.Updates() {
				}
			}()
			for {
				select {
				case <-ctx.Done():
					return
				case en, ok := <-w.Updates():
					if !ok {
						return
					}
					if en != nil {
						g.onLease(en)
					}
				}
			}
		}, nil))
	}
	sub, err := nc.Subscribe(prefix+".out.>", g.onEffect)
	if err != nil {
		g.close(ctx)
		return nil, err
	}
	_ = sub.SetPendingLimits(-1, -1)
	g.stops = append(g.stops, func() { _ = sub.Unsubscribe() })
	return g, nil
}

// onLease folds a lease bucket entry into the view. The record is the
// lease's JSON, which leasehold keeps readable with `nats kv get`.
func (g *procGroup) onLease(en jetstream.KeyValueEntry) {
	live := en.Operation() == jetstream.KeyValuePut
	g.mu.Lock()
	defer g.mu.Unlock()
	if m, ok := strings.CutPrefix(en.Key(), "member."); ok {
		if live {
			g.live[m] = true
		} else {
			delete(g.live, m)
		}
		return
	}
	p, err := leasehold.ParsePartition(strings.TrimPrefix(en.Key(), "partition."))
	if err != nil || int(p) >= g.partitions {
		return
	}
	if !live {
		g.slots[p] = leaseSlot{}
		return
	}
	var r struct {
		Holder string `json:"holder"`
		Epoch  uint64 `json:"epoch"`
	}
	_ = json.Unmarshal(en.Value(), &r)
	epoch := leasehold.Epoch(r.Epoch)
	if epoch == 0 {
		epoch = leasehold.Epoch(en.Revision())
	}
	g.slots[p] = leaseSlot{holder: r.Holder, epoch: epoch}
}

// onEffect notes the first effect of each partition under each new epoch.
// Barriers are not work, and are skipped.
func (g *procGroup) onEffect(m *nats.Msg) {
	if m.Header.Get(leasehold.HeaderBarrier) != "" {
		return
	}
	st, err := leasehold.StampFromHeader(m.Header)
	if err != nil || int(st.Partition) >= g.partitions {
		return
	}
	now := time.Now()
	g.mu.Lock()
	if st.Epoch > g.seen[st.Partition].epoch {
		g.seen[st.Partition] = effectSeen{epoch: st.Epoch, at: now}
	}
	g.mu.Unlock()
}

// start starts a worker process named id.
func (g *procGroup) start(id string) error {
	if g.mode != asProcess {
		return g.startInProcess(id)
	}
	args := []string{"worker", "--nats", g.e.url, "--prefix", g.prefix, "--bucket", g.bucket,
		"--partitions", strconv.Itoa(g.partitions), "--ttl", g.ttl.String(), "--worker-id", id,
		"--http=", "--log-level", "warn", "--drain-timeout", "10s"}
	p, err := fleet.Start(id, append(args, g.args...), g.e.fleetOptions())
	if err != nil {
		return err
	}
	g.mu.Lock()
	g.procs[id] = p
	g.mu.Unlock()
	go func() {
		<-p.Exited()
		g.mu.Lock()
		g.exits[id] = struct{}{}
		g.mu.Unlock()
	}()
	return nil
}

// registered says whether every one of ids is a registered member.
func (g *procGroup) registered(ids []string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, id := range ids {
		if !g.live[id] {
			return false
		}
	}
	return true
}

// running lists the processes that have not exited.
func (g *procGroup) running() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	var ids []string
	for id := range g.procs {
		if _, gone := g.exits[id]; !gone {
			ids = append(ids, id)
		}
	}
	for id := range g.inStops {
		ids = append(ids, id)
	}
	return ids
}

func (g *procGroup) proc(id string) *fleet.Proc {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.procs[id]
}

// holdings returns the partitions id holds, with their epochs.
func (g *procGroup) holdings(id string) map[leasehold.Partition]leasehold.Epoch {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := map[leasehold.Partition]leasehold.Epoch{}
	for p, s := range g.slots {
		if s.holder == id {
			out[leasehold.Partition(p)] = s.epoch
		}
	}
	return out
}

// owned reports whether every partition is held.
func (g *procGroup) owned() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, s := range g.slots {
		if s.holder == "" {
			return false
		}
	}
	return true
}

// balanced reports whether every partition is held by one of workers,
// each holding its share; with working, also whether every partition has
// produced an effect under its current epoch.
func (g *procGroup) balanced(workers []string, working bool) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	count := make(map[string]int, len(workers))
	for _, w := range workers {
		count[w] = 0
	}
	for p, s := range g.slots {
		n, ok := count[s.holder]
		if !ok {
			return false
		}
		count[s.holder] = n + 1
		if working && g.seen[p].epoch < s.epoch {
			return false
		}
	}
	lo, hi := g.partitions/len(workers), (g.partitions+len(workers)-1)/len(workers)
	for _, n := range count {
		if n < lo || n > hi {
			return false
		}
	}
	return true
}

// unbalanced says why workers are not balanced and working: who holds
// how many partitions, and which held partitions have produced no effect
// under their holder's epoch.
func (g *procGroup) unbalanced(workers []string) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	count := make(map[string]int, len(workers))
	for _, w := range workers {
		count[w] = 0
	}
	var idle []string
	for p, s := range g.slots {
		count[s.holder]++
		if s.holder != "" && g.seen[p].epoch < s.epoch {
			idle = append(idle, fmt.Sprintf("%d (%s at epoch %d; last effect at %d)", p, s.holder, s.epoch, g.seen[p].epoch))
		}
	}
	free := count[""]
	delete(count, "")
	return fmt.Sprintf("%d partitions free, held: %v, held but without an effect under their epoch: %v", free, count, idle)
}

// resumed returns, once every partition of parts has produced an effect
// under an epoch above the one given, the time the last of them did.
func (g *procGroup) resumed(parts map[leasehold.Partition]leasehold.Epoch) (time.Time, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var last time.Time
	for p, e := range parts {
		s := g.seen[p]
		if s.epoch <= e {
			return time.Time{}, false
		}
		if s.at.After(last) {
			last = s.at
		}
	}
	return last, true
}

// feed enqueues one job on every partition every interval until the
// returned stop is called, so that every partition always has work.
func (g *procGroup) feed(ctx context.Context, interval time.Duration) (func(), error) {
	prod, err := worker.NewProducer(g.js, worker.ProducerConfig{Prefix: g.prefix, Partitions: g.partitions})
	if err != nil {
		return nil, err
	}
	stop := g.e.goRun(ctx, func(ctx context.Context) {
		t := time.NewTicker(interval)
		defer t.Stop()
		data := make([]byte, 64)
		for ctx.Err() == nil {
			b := prod.Batch()
			for p := range g.partitions {
				_ = b.EnqueueTo(ctx, leasehold.Partition(p), data)
			}
			_, _ = b.Wait(ctx)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
		}
	}, nil)
	g.stops = append(g.stops, stop)
	return stop, nil
}

// close kills every process, stops watching and drops the streams.
func (g *procGroup) close(ctx context.Context) {
	g.mu.Lock()
	procs := make([]*fleet.Proc, 0, len(g.procs))
	for _, p := range g.procs {
		procs = append(procs, p)
	}
	g.mu.Unlock()
	for _, p := range procs {
		_ = p.Kill()
	}
	for _, p := range procs {
		<-p.Exited()
	}
	for _, stop := range g.inStops {
		stop()
	}
	for i := len(g.stops) - 1; i >= 0; i-- {
		g.stops[i]()
	}
	g.e.dropStreams(ctx, g.js, g.prefix+"-")
	g.e.release(g.nc)
}

// rssMiB reads a process's resident set size from /proc, in MiB.
func rssMiB(pid int) (float64, error) { return statusMiB(pid, "VmRSS") }

// statusMiB reads a field of /proc/<pid>/status that is given in kB, in
// MiB: VmRSS (all resident pages), or RssAnon (the process's own, without
// the binary's code and other file pages, which every worker on a host
// shares).
func statusMiB(pid int, field string) (float64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			kb, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")))
			if err != nil {
				return 0, err
			}
			return float64(kb) / 1024, nil
		}
	}
	return 0, fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

type runMode int

const (
	asProcess runMode = iota // `leasehold worker` processes
	asWorker                 // worker.Worker in this process
	asLeases                 // coordinator.Coordinator.Run in this process
)

func (m runMode) String() string {
	return [...]string{"`leasehold worker` processes", "workers in one process", "lease-layer members (coordinator.Run) in one process"}[m]
}

// startInProcess runs a worker, or its lease layer alone, in this process
// on a connection of its own. The worker's handler emits one effect per
// job, as `leasehold worker`'s does.
func (g *procGroup) startInProcess(id string) error {
	nc, js, err := g.e.connect("bench worker " + id)
	if err != nil {
		return err
	}
	b, err := coordinator.OpenBucket(context.Background(), js, g.bucket)
	if err != nil {
		g.e.release(nc)
		return err
	}
	if g.mode == asLeases {
		c, err := coordinator.New(b, coordinator.Config{Worker: id, Partitions: g.partitions, TTL: g.ttl, Logger: g.e.quiet()})
		if err != nil {
			g.e.release(nc)
			return err
		}
		g.addStop(id, g.e.goRun(context.Background(), func(ctx context.Context) { _ = c.Run(ctx) }, func() { g.e.release(nc) }))
		return nil
	}
	w, err := worker.New(worker.Config{
		JetStream:   js,
		Prefix:      g.prefix,
		Partitions:  g.partitions,
		Handler:     worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error { return j.Emit(ctx, j.Data) }),
		Bucket:      b,
		Coordinator: coordinator.Config{Worker: id, TTL: g.ttl, Logger: g.e.quiet()},
		Logger:      g.e.quiet(),
	})
	if err != nil {
		g.e.release(nc)
		return err
	}
	g.addStop(id, g.e.goRun(context.Background(), func(ctx context.Context) { _ = w.Run(ctx) }, func() { g.e.release(nc) }))
	return nil
}

func (g *procGroup) addStop(id string, stop func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.inStops == nil {
		g.inStops = map[string]func(){}
	}
	g.inStops[id] = stop
}
