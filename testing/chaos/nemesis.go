package chaos

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/history"
	"github.com/leasehold/leasehold/internal/leader"
	"github.com/leasehold/leasehold/worker"
)

// weights say how often each fault is picked.
var weights = map[string]int{
	FaultPause: 4, FaultKill: 2, FaultTerm: 1, FaultPartition: 2,
	FaultSinkKill: 1, FaultSinkTerm: 1, FaultNATSRestart: 1, FaultNodeKill: 1,
	FaultForged: 1, FaultGarbage: 1, FaultLeaseGarbage: 1, FaultPreempt: 1, FaultForgedMarker: 1,
	FaultRelayPause: 1, FaultRelayKill: 1, FaultReceiverDown: 1,
}

// FaultNames lists the fault types, sorted: the values Config.Faults and
// `leasehold chaos --faults` take.
func FaultNames() []string {
	var out []string
	for f := range faultKinds {
		out = append(out, f)
	}
	slices.Sort(out)
	return out
}

// planFaults settles which faults this run injects.
func (h *harness) planFaults() {
	want := h.cfg.Faults
	if len(want) == 0 {
		for f := range faultKinds {
			want = append(want, f)
		}
		slices.Sort(want)
	}
	for _, f := range want {
		switch {
		case f == FaultNodeKill && !h.cfg.Cluster:
			if len(h.cfg.Faults) > 0 {
				h.skip(f, fmt.Errorf("needs a cluster"))
			}
			continue
		case f == FaultNATSRestart && h.cfg.Cluster:
			if len(h.cfg.Faults) > 0 {
				h.skip(f, fmt.Errorf("restarts the single server; a cluster kills nodes instead"))
			}
			continue
		case (f == FaultForged || f == FaultGarbage || f == FaultLeaseGarbage || f == FaultPreempt || f == FaultForgedMarker) && h.cfg.Unfenced:
			// The unfenced sink applies whatever it reads: it is there to
			// show what a missing fence lets through, not to be attacked.
			continue
		}
		h.faults = append(h.faults, f)
	}
}

func (h *harness) wants(f string) bool { return slices.Contains(h.faults, f) }

// nemesis injects one fault at a time until deadline.
func (h *harness) nemesis(ctx context.Context, deadline time.Time) error {
	for time.Now().Before(deadline) {
		if err := ctx.Err(); err != nil {
			return err
		}
		f := h.pick()
		if f == "" {
			return sleepCtx(ctx, time.Until(deadline))
		}
		h.log.Info("chaos: fault", "fault", f)
		if err := h.inject(ctx, f); err != nil {
			return fmt.Errorf("chaos: %s: %w", f, err)
		}
		gap := time.Duration(float64(h.cfg.FaultGap) * (0.5 + h.rnd.Float64()))
		if err := sleepCtx(ctx, min(gap, time.Until(deadline))); err != nil && time.Now().Before(deadline) {
			return err
		}
	}
	return nil
}

// pick returns the next fault: every type once, in random order, so that
// a short run meets them all; then at random by weight.
func (h *harness) pick() string {
	if h.pending == nil {
		h.pending = []string{}
		for _, f := range h.faults {
			if f != FaultPartition || h.net != nil {
				h.pending = append(h.pending, f)
			}
		}
		h.rnd.Shuffle(len(h.pending), func(i, j int) { h.pending[i], h.pending[j] = h.pending[j], h.pending[i] })
	}
	if len(h.pending) > 0 {
		f := h.pending[0]
		h.pending = h.pending[1:]
		return f
	}
	total := 0
	for _, f := range h.faults {
		if f == FaultPartition && h.net == nil {
			continue
		}
		total += weights[f]
	}
	if total == 0 {
		return ""
	}
	n := h.rnd.IntN(total)
	for _, f := range h.faults {
		if f == FaultPartition && h.net == nil {
			continue
		}
		if n -= weights[f]; n < 0 {
			return f
		}
	}
	return ""
}

func (h *harness) inject(ctx context.Context, f string) error {
	switch f {
	case FaultPause:
		return h.pause(ctx)
	case FaultKill, FaultTerm:
		return h.crashWorker(ctx, f)
	case FaultSinkKill, FaultSinkTerm:
		return h.crashSink(ctx, f)
	case FaultNATSRestart, FaultNodeKill:
		return h.restartNode(ctx, f)
	case FaultPartition:
		return h.partition(ctx)
	case FaultForged:
		return h.forge(ctx)
	case FaultGarbage:
		return h.garbage(ctx)
	case FaultLeaseGarbage:
		return h.leaseGarbage(ctx)
	case FaultPreempt:
		return h.preempt(ctx)
	case FaultForgedMarker:
		return h.forgeMarkers(ctx)
	case FaultRelayPause:
		return h.pauseRelay(ctx)
	case FaultRelayKill:
		return h.killRelay(ctx)
	case FaultReceiverDown:
		return h.receiverDown(ctx)
	}
	return fmt.Errorf("unknown fault %q", f)
}

func eventFor(proc, reason string) history.Event { return history.Event{Proc: proc, Reason: reason} }

// victim picks a running worker, preferring one that holds partitions.
func (h *harness) victim(ctx context.Context, allowNetns bool) (*proc, []leasehold.Partition) {
	h.mu.Lock()
	var cands []*proc
	for _, w := range h.workers {
		if w.running() && !w.p.Paused() && (allowNetns || !w.netns) {
			cands = append(cands, w)
		}
	}
	h.mu.Unlock()
	if len(cands) == 0 {
		return nil, nil
	}
	held := map[string][]leasehold.Partition{}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if st, err := h.bucket.Snapshot(sctx); err == nil {
		for _, p := range st.Partitions {
			held[p.Holder] = append(held[p.Holder], p.Partition)
		}
	}
	var holders []*proc
	for _, w := range cands {
		if len(held[w.id]) > 0 {
			holders = append(holders, w)
		}
	}
	if len(holders) > 0 {
		cands = holders
	}
	w := cands[h.rnd.IntN(len(cands))]
	return w, held[w.id]
}

// pause is the zombie maker. Half the time the worker wakes as soon as
// others hold every partition it had (so its late writes land right
// behind the successor's barrier, before the successor re-runs the job),
// otherwise after a random time past the TTL.
func (h *harness) pause(ctx context.Context) error {
	w, held := h.victim(ctx, true)
	if w == nil {
		return nil
	}
	h.record(eventFor(w.id, FaultPause))
	if err := w.p.Pause(); err != nil {
		return nil // it exited meanwhile: the next fault will find it restarted
	}
	// An unfenced run is there to show what the fence stops: all its
	// pauses end at the take-over.
	if (h.cfg.Unfenced || h.rnd.IntN(2) == 0) && len(held) > 0 {
		if err := h.waitTakenOver(ctx, w.id, held, 6*h.cfg.TTL); err != nil {
			return err
		}
		if err := sleepCtx(ctx, time.Duration(h.rnd.IntN(300))*time.Millisecond); err != nil {
			return err
		}
	} else if err := sleepCtx(ctx, h.jitter(h.cfg.TTL, 1.5, 3)); err != nil {
		return err
	}
	if err := w.p.Resume(); err == nil {
		h.record(eventFor(w.id, markResume))
	}
	return nil
}

// waitTakenOver waits until every partition in held has a holder other
// than id, at most limit.
func (h *harness) waitTakenOver(ctx context.Context, id string, held []leasehold.Partition, limit time.Duration) error {
	wctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	for {
		st, err := h.bucket.Snapshot(wctx)
		if err == nil {
			taken := 0
			for _, p := range st.Partitions {
				if slices.Contains(held, p.Partition) && p.Holder != "" && p.Holder != id {
					taken++
				}
			}
			if taken == len(held) {
				return nil
			}
		}
		select {
		case <-wctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// crashWorker kills (SIGKILL) or stops (SIGTERM) a worker, and starts its
// replacement a moment later.
func (h *harness) crashWorker(ctx context.Context, f string) error {
	w, _ := h.victim(ctx, false)
	if w == nil {
		return nil
	}
	h.record(eventFor(w.id, f))
	if f == FaultKill {
		_ = w.p.Kill()
		<-w.p.Exited()
	} else if err := w.p.Stop(15 * time.Second); err != nil {
		h.log.Warn("chaos: worker did not drain cleanly", "worker", w.id, "err", err)
	}
	if err := sleepCtx(ctx, h.jitter(time.Second, 0.2, 2)); err != nil {
		return err
	}
	return h.restart(w)
}

func (h *harness) crashSink(ctx context.Context, f string) error {
	s := h.sink
	if !s.running() {
		return h.restart(s)
	}
	h.record(eventFor(s.id, f))
	if f == FaultSinkKill {
		_ = s.p.Kill()
		<-s.p.Exited()
	} else if err := s.p.Stop(15 * time.Second); err != nil {
		h.log.Warn("chaos: sink did not stop cleanly", "err", err)
	}
	if err := sleepCtx(ctx, h.jitter(time.Second, 0.2, 2)); err != nil {
		return err
	}
	return h.restart(s)
}

// restartNode stops the single server, or one node of the cluster, and
// starts it again on its store. In a cluster it then waits for the node
// to catch up, so that the next kill does not take a quorum away.
func (h *harness) restartNode(ctx context.Context, f string) error {
	i := h.rnd.IntN(h.srv.size())
	h.record(eventFor(h.srv.name(i), f))
	h.srv.stop(i)
	down := h.jitter(time.Second, 0.5, 3)
	if h.srv.size() > 1 {
		down = h.jitter(2*time.Second, 1, 2.5)
	}
	if err := sleepCtx(ctx, down); err != nil {
		return err
	}
	if err := h.srv.start(i); err != nil {
		return err
	}
	h.record(eventFor(h.srv.name(i), markNodeRestart))
	if h.srv.size() == 1 {
		h.awaitEnqueue(ctx)
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for !h.srv.current(i) {
		if err := sleepCtx(wctx, 100*time.Millisecond); err != nil {
			h.log.Warn("chaos: restarted node not current after 30s", "node", h.srv.name(i))
			return ctx.Err()
		}
	}
	return nil
}

// awaitEnqueue waits, for up to 30 s, until the producer has an enqueue
// acknowledged by the server that was just started again, so that the
// next fault's gap is time the server serves. A server's JetStream takes
// a while to come back on a loaded machine, and the producer's backoff
// grows with every failed try: restarts that followed one another by the
// gap alone let no job in during a whole run. A producer that gets none
// in is logged, and the run goes on; its checks see what got in.
func (h *harness) awaitEnqueue(ctx context.Context) {
	// A signal left from before the restart says nothing of this server.
	select {
	case <-h.enqueued:
	default:
	}
	t := time.NewTimer(30 * time.Second)
	defer t.Stop()
	select {
	case <-h.enqueued:
	case <-t.C:
		h.log.Warn("chaos: no enqueue acknowledged within 30s of the server's restart")
	case <-ctx.Done():
	}
}

// partition cuts the worker in the network namespace off for longer than
// the TTL, then heals.
func (h *harness) partition(ctx context.Context) error {
	w := h.netWorker()
	if w == nil || !w.running() {
		return nil
	}
	h.record(eventFor(w.id, FaultPartition))
	if err := h.net.cutOff(); err != nil {
		return err
	}
	if err := sleepCtx(ctx, h.jitter(h.cfg.TTL, 1.5, 3)); err != nil {
		return err
	}
	if err := h.net.heal(); err != nil {
		return err
	}
	h.record(eventFor(w.id, markHeal))
	return nil
}

// forge publishes effects with forged epochs: one the lease bucket never
// issued (far above the fenced epoch), which a sink with verified epochs
// must refuse, and one below every epoch the partition ever had, which
// the fence must refuse. Neither may be applied.
func (h *harness) forge(ctx context.Context) error {
	p := leasehold.Partition(h.rnd.IntN(h.cfg.Partitions))
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	fenced, err := h.bucket.FencedEpoch(fctx, p)
	if err != nil || fenced == 0 {
		return nil // the bucket is away (a restart): try another time
	}
	unissued := leasehold.MaxEpoch
	if fenced < leasehold.MaxEpoch-1<<40 {
		unissued = fenced + 1<<40
	}
	for _, e := range []leasehold.Epoch{unissued, 1} {
		key := fmt.Sprintf("chaos.forged.%d", h.rnd.Uint64())
		msg := nats.NewMsg(worker.OutputSubject(prefix, p))
		leasehold.Stamp{Scope: prefix, Partition: p, Epoch: e, Acquisition: "forged", Key: key, Worker: "forger"}.SetHeader(msg.Header)
		msg.Data = []byte("forged")
		h.publishInjected(fctx, msg, history.Event{Proc: effectProc, Reason: FaultForged, Partition: uint32(p), Epoch: uint64(e), Key: key})
	}
	return nil
}

// garbage publishes messages no worker could have written: no stamp, or
// a stamp with a malformed field, with random payloads. The sink must
// refuse each and carry on.
func (h *harness) garbage(ctx context.Context) error {
	p := leasehold.Partition(h.rnd.IntN(h.cfg.Partitions))
	gctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	valid := func(key string) nats.Header {
		hd := nats.Header{}
		leasehold.Stamp{Scope: prefix, Partition: p, Epoch: 42, Acquisition: "garbage", Key: key}.SetHeader(hd)
		return hd
	}
	variants := []func(key string) nats.Header{
		func(string) nats.Header { return nats.Header{} },
		func(k string) nats.Header { h := valid(k); h.Set(leasehold.HeaderEpoch, "-7"); return h },
		func(k string) nats.Header { h := valid(k); h.Set(leasehold.HeaderEpoch, "0x10"); return h },
		func(k string) nats.Header { h := valid(k); h.Set(leasehold.HeaderEpoch, "0"); return h },
		func(k string) nats.Header { h := valid(k); h.Set(leasehold.HeaderPartition, "99999999"); return h },
		func(k string) nats.Header { h := valid(k); h.Set(leasehold.HeaderKey, "chaos garbage"); return h },
		func(k string) nats.Header { h := valid(k); h[leasehold.HeaderEpoch] = []string{"5", "6"}; return h },
		func(k string) nats.Header { h := valid(k); delete(h, leasehold.HeaderKey); return h },
	}
	// A valid stamp of the partition's newest write in the log (so it
	// passes the fence and raises nothing) whose key cannot be a KV key:
	// the runner accepts it, and the KV sink can never apply it.
	if cur, ok := h.newestStamp(gctx, p); ok {
		variants = append(variants, func(k string) nats.Header {
			hd := nats.Header{}
			cur.Key, cur.Worker = k+"*", "garbler"
			cur.SetHeader(hd)
			return hd
		})
	}
	for range 3 {
		key := fmt.Sprintf("chaos.garbage.%d", h.rnd.Uint64())
		msg := nats.NewMsg(worker.OutputSubject(prefix, p))
		v := h.rnd.IntN(len(variants))
		msg.Header = variants[v](key)
		if k := msg.Header.Get(leasehold.HeaderKey); strings.HasSuffix(k, "*") {
			key = k
		}
		msg.Data = make([]byte, h.rnd.IntN(512))
		for i := range msg.Data {
			msg.Data[i] = byte(h.rnd.Uint32())
		}
		h.publishInjected(gctx, msg, history.Event{Proc: effectProc, Reason: FaultGarbage, Partition: uint32(p), Key: key})
	}
	return nil
}

// leaseGarbage puts, without a TTL, random bytes at a partition's lease
// key (its holder's next renewal fails, and the group takes the partition
// over once the record has stayed unchanged for a TTL), at a member key (it
// must not count as a worker, or the assignment would leave its share
// unheld), and at a key leasehold does not use.
func (h *harness) leaseGarbage(ctx context.Context) error {
	p := leasehold.Partition(h.rnd.IntN(h.cfg.Partitions))
	gctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	junk := make([]byte, 1+h.rnd.IntN(64))
	for i := range junk {
		junk[i] = byte(h.rnd.Uint32())
	}
	n := h.rnd.Uint64()
	keys := []string{"partition." + p.String(), fmt.Sprintf("member.chaos-ghost-%d", n), fmt.Sprintf("chaos.garbage.%d", n)}
	for _, k := range keys {
		if _, err := h.bucket.KeyValue().Put(gctx, k, junk); err != nil {
			h.log.Warn("chaos: lease-bucket garbage not stored", "key", k, "err", err)
		}
	}
	h.record(history.Event{Proc: "lease-bucket", Reason: FaultLeaseGarbage, Partition: uint32(p)})
	return nil
}

// preempt publishes unstamped messages under the message IDs that the
// effect of partition p's newest enqueued job would have if they were its
// key and epoch alone. The job's real effect must still be stored and
// applied, and the injected messages refused.
func (h *harness) preempt(ctx context.Context) error {
	p := leasehold.Partition(h.rnd.IntN(h.cfg.Partitions))
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cur, ok := h.newestStamp(pctx, p)
	if !ok {
		return nil
	}
	job, err := leader.NewReader(h.js, worker.JobsStream(prefix)).Last(pctx, worker.JobSubject(prefix, p))
	if err != nil || job == nil {
		return nil
	}
	for _, e := range []leasehold.Epoch{cur.Epoch, cur.Epoch + 1} {
		key := leasehold.EffectKey(prefix, p, job.Seq, 0)
		msg := nats.NewMsg(worker.OutputSubject(prefix, p))
		msg.Header.Set(nats.MsgIdHdr, key+"@"+e.String())
		msg.Header.Set(leasehold.HeaderKey, key)
		msg.Data = []byte("pre-empted")
		h.publishInjected(pctx, msg, history.Event{Proc: effectProc, Reason: FaultPreempt, Partition: uint32(p), Epoch: uint64(e)})
	}
	return nil
}

func (h *harness) publishInjected(ctx context.Context, msg *nats.Msg, e history.Event) {
	ack, err := h.js.PublishMsg(ctx, msg)
	if err != nil {
		h.log.Warn("chaos: injection not stored", "err", err)
		return
	}
	e.Position = ack.Sequence
	h.record(e)
}

// newestStamp is the stamp of the newest message in partition p's effect
// log, read through the stream's leader, when it has a valid one.
func (h *harness) newestStamp(ctx context.Context, p leasehold.Partition) (leasehold.Stamp, bool) {
	m, err := leader.NewReader(h.js, worker.EffectsStream(prefix)).Last(ctx, worker.OutputSubject(prefix, p))
	if err != nil || m == nil {
		return leasehold.Stamp{}, false
	}
	st, err := leasehold.StampFromHeader(m.Header)
	return st, err == nil
}

// jitter returns base times a random factor in [lo, hi).
func (h *harness) jitter(base time.Duration, lo, hi float64) time.Duration {
	return time.Duration(float64(base) * (lo + h.rnd.Float64()*(hi-lo)))
}
