package chaos

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/leasehold/leasehold/internal/fleet"
)

// proc is one slot of the fleet: a worker, the sink or a relay. A worker
// or a relay that is killed or stopped is replaced by a new incarnation
// with a new ID, as a replaced pod would be; the sink keeps its name,
// which is its durable consumer's (the relays share theirs, relayName).
type proc struct {
	slot   string // w1, w2, ..., wn (the one in the network namespace), sink, relay-1, relay-2
	incarn int
	id     string // the worker ID, and the history file's name
	netns  bool
	p      *fleet.Proc
}

func (p *proc) running() bool {
	if p.p == nil {
		return false
	}
	select {
	case <-p.p.Exited():
		return false
	default:
		return true
	}
}

func (h *harness) startProcesses() error {
	h.mu.Lock()
	for i := range h.cfg.Workers {
		h.workers = append(h.workers, &proc{slot: fmt.Sprintf("w%d", i+1)})
	}
	if h.net != nil {
		h.workers = append(h.workers, &proc{slot: "wn", netns: true})
	}
	h.sink = &proc{slot: sinkName}
	h.relays = []*proc{{slot: relayName + "-1"}, {slot: relayName + "-2"}}
	workers, relays := h.workers, h.relays
	h.mu.Unlock()
	if err := h.startSink(); err != nil {
		return err
	}
	for _, r := range relays {
		if err := h.startRelay(r); err != nil {
			return err
		}
	}
	for _, w := range workers {
		if err := h.startWorker(w); err != nil {
			return err
		}
	}
	return nil
}

func (h *harness) startWorker(w *proc) error {
	w.incarn++
	w.id = fmt.Sprintf("%s-%d", w.slot, w.incarn)
	urls := h.srv.urls()
	if w.netns {
		urls = h.net.urls()
	}
	args := []string{"worker",
		"--nats", urls, "--prefix", prefix, "--bucket", leaseKV,
		"--partitions", fmt.Sprint(h.cfg.Partitions),
		"--worker-id", w.id,
		"--ttl", h.cfg.TTL.String(),
		"--drain-timeout", "5s",
		"--work-time", h.cfg.WorkTime.String(),
		"--partition-concurrency", fmt.Sprint(h.cfg.PartitionConcurrency),
		"--history", h.histDir,
		"--http", "",
		"--log-level", "warn",
	}
	if !h.cfg.Unfenced {
		// One job in 7 fails its first attempt after emitting through
		// the SDK: nothing of that attempt may be applied. (An unfenced
		// run proves the checker finds stale applications; a sink that
		// applies everything also applies what all-or-none drops, abort
		// markers included, which would only blur that.)
		args = append(args, "--fail-first-attempt", "7")
	}
	if !w.netns {
		// The zombie makers. The worker in the namespace emits through
		// the SDK's Job.Emit instead, so that path meets partitions.
		args = append(args, "--write-behind")
	}
	bin := h.bin
	if w.netns {
		bin, args = h.net.wrap(h.bin, args)
	}
	p, err := fleet.Start(w.id, args, fleet.Options{Binary: bin, LogDir: h.logDir})
	if err != nil {
		return fmt.Errorf("chaos: %w", err)
	}
	w.p = p
	h.log.Debug("chaos: worker started", "id", w.id, "pid", p.Pid())
	return nil
}

func (h *harness) startSink() error {
	s := h.sink
	s.incarn++
	s.id = sinkName
	args := []string{"sink",
		"--nats", h.srv.urls(), "--prefix", prefix, "--bucket", leaseKV,
		"--kind", "kv", "--kv-bucket", sinkKV,
		"--name", sinkName,
		"--history", h.histDir,
		"--http", "",
		"--log-level", "warn",
	}
	// A fenced sink verifies epochs by default: the forged-epoch faults
	// test that default.
	if h.cfg.Unfenced {
		args = append(args, "--unsafe-no-fence", "--verify-epochs=false")
	}
	p, err := fleet.Start(fmt.Sprintf("%s-%d", sinkName, s.incarn), args, fleet.Options{Binary: h.bin, LogDir: h.logDir})
	if err != nil {
		return fmt.Errorf("chaos: %w", err)
	}
	s.p = p
	return nil
}

// startRelay starts an HTTP relay, as `leasehold sink --kind http` runs
// in production: a stream sink runner of its own on the effect log, run
// only while the relay holds the lock both relays share, sending each
// admitted effect to the receiver. Its request timeout and its waits
// between tries are short, so that it is back soon after the receiver.
func (h *harness) startRelay(r *proc) error {
	r.incarn++
	r.id = fmt.Sprintf("%s-%d", r.slot, r.incarn)
	args := []string{"sink",
		"--nats", h.srv.urls(), "--prefix", prefix, "--bucket", leaseKV,
		"--kind", "http", "--url", h.recv.url(),
		"--name", relayName, "--relay-id", r.id,
		"--lock", relayLock, "--lock-ttl", h.cfg.TTL.String(),
		"--timeout", "5s", "--max-backoff", "2s",
		// The relays' decisions are kept apart from the histories the
		// checker reads (it judges the receiver's record), for a look
		// when a run fails.
		"--history", filepath.Join(h.dir, "relay-history"),
		"--http", "",
		"--log-level", "warn",
	}
	p, err := fleet.Start(r.id, args, fleet.Options{Binary: h.bin, LogDir: h.logDir})
	if err != nil {
		return fmt.Errorf("chaos: %w", err)
	}
	r.p = p
	return nil
}

// restart starts a new incarnation of a process that has exited.
func (h *harness) restart(p *proc) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	var err error
	switch {
	case p == h.sink:
		err = h.startSink()
	case strings.HasPrefix(p.slot, relayName):
		err = h.startRelay(p)
	default:
		err = h.startWorker(p)
	}
	if err == nil {
		h.record(eventFor(p.id, markRestart))
	}
	return err
}

// healAll undoes whatever the last fault left: it continues paused
// processes, heals the network, starts stopped servers and processes.
func (h *harness) healAll(ctx context.Context) error {
	if h.net != nil && h.net.cut {
		if err := h.net.heal(); err != nil {
			return err
		}
		h.record(eventFor(h.netWorker().id, markHeal))
	}
	for i := range h.srv.size() {
		if !h.srv.running(i) {
			if err := h.srv.start(i); err != nil {
				return err
			}
			h.record(eventFor(h.srv.name(i), markNodeRestart))
		}
	}
	if h.recv != nil {
		h.recv.set503(false)
		if err := h.recv.accept(ctx); err != nil {
			return err
		}
	}
	h.mu.Lock()
	all := append(append(append([]*proc(nil), h.workers...), h.relays...), h.sink)
	h.mu.Unlock()
	for _, p := range all {
		if p.p != nil && p.p.Paused() {
			_ = p.p.Resume()
			h.record(eventFor(p.id, markResume))
		}
		if !p.running() {
			if err := h.restart(p); err != nil {
				return err
			}
		}
	}
	return ctx.Err()
}

// stopAll stops every process gracefully (a paused one is continued
// first), killing what does not stop in time. It is safe to call twice.
func (h *harness) stopAll() {
	h.mu.Lock()
	all := append(append(append([]*proc(nil), h.workers...), h.relays...), h.sink)
	h.mu.Unlock()
	done := make(chan struct{}, len(all))
	for _, p := range all {
		go func() {
			defer func() { done <- struct{}{} }()
			if p != nil && p.running() {
				if err := p.p.Stop(15 * time.Second); err != nil {
					h.log.Warn("chaos: process did not stop cleanly", "proc", p.id, "err", err)
				}
			}
		}()
	}
	for range all {
		<-done
	}
}

func (h *harness) netWorker() *proc {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, w := range h.workers {
		if w.netns {
			return w
		}
	}
	return nil
}
