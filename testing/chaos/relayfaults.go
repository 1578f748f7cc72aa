package chaos

import (
	"context"
	"time"

	"github.com/leasehold/leasehold"
)

// relayByID returns the running relay whose incarnation is id.
func (h *harness) relayByID(id string) *proc {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.relays {
		if r.id == id && r.running() && !r.p.Paused() {
			return r
		}
	}
	return nil
}

// someRelay picks a running relay that is not paused.
func (h *harness) someRelay() *proc {
	h.mu.Lock()
	var cands []*proc
	for _, r := range h.relays {
		if r.running() && !r.p.Paused() {
			cands = append(cands, r)
		}
	}
	h.mu.Unlock()
	if len(cands) == 0 {
		return nil
	}
	return cands[h.rnd.IntN(len(cands))]
}

// pauseRelay is the relay's zombie maker. The receiver holds the next
// relayed request back from its Verifier; the relay that sent it is
// paused; once the other relay holds the lock and a request of its newer
// epoch was handled, the held request goes on to the Verifier, which must
// refuse it, and the paused relay wakes past its lock's TTL to find its
// requests refused. Without a request to catch (no traffic for a few
// seconds), a relay is paused past the lock's TTL.
func (h *harness) pauseRelay(ctx context.Context) error {
	hr := h.recv.armHold()
	var held leasehold.Lease
	select {
	case held = <-hr.got:
	case <-time.After(5 * time.Second):
		h.recv.disarm(hr)
		r := h.someRelay()
		if r == nil {
			return nil
		}
		return h.pauseFor(ctx, r, h.jitter(h.cfg.TTL, 1.5, 3))
	case <-ctx.Done():
		h.recv.disarm(hr)
		return ctx.Err()
	}
	defer hr.free()
	r := h.relayByID(held.Holder)
	if r == nil {
		return nil // it exited meanwhile; the request goes on as it came
	}
	h.record(eventFor(r.id, FaultRelayPause))
	if err := r.p.Pause(); err != nil {
		return nil
	}
	// The other relay takes the lock after the TTL, and delivers; it may
	// itself be down, so this is bounded.
	wctx, cancel := context.WithTimeout(ctx, 8*h.cfg.TTL)
	for h.recv.topRelayEpoch() <= held.Epoch && wctx.Err() == nil {
		_ = sleepCtx(wctx, 50*time.Millisecond)
	}
	cancel()
	hr.free()
	if err := sleepCtx(ctx, time.Duration(h.rnd.IntN(300))*time.Millisecond); err != nil {
		return err
	}
	if err := r.p.Resume(); err == nil {
		h.record(eventFor(r.id, markResume))
	}
	return nil
}

// pauseFor pauses r for d.
func (h *harness) pauseFor(ctx context.Context, r *proc, d time.Duration) error {
	h.record(eventFor(r.id, FaultRelayPause))
	if err := r.p.Pause(); err != nil {
		return nil
	}
	if err := sleepCtx(ctx, d); err != nil {
		return err
	}
	if err := r.p.Resume(); err == nil {
		h.record(eventFor(r.id, markResume))
	}
	return nil
}

// killRelay kills a relay with SIGKILL and starts its replacement a
// moment later: what it had fetched and not delivered comes back to the
// next holder.
func (h *harness) killRelay(ctx context.Context) error {
	r := h.someRelay()
	if r == nil {
		return nil
	}
	h.record(eventFor(r.id, FaultRelayKill))
	_ = r.p.Kill()
	<-r.p.Exited()
	if err := sleepCtx(ctx, h.jitter(time.Second, 0.2, 2)); err != nil {
		return err
	}
	return h.restart(r)
}

// receiverDown takes the receiver down for one to three TTLs' halves:
// half the time it answers 503, otherwise it refuses connections. The
// relays retry; nothing may be lost.
func (h *harness) receiverDown(ctx context.Context) error {
	refuse := h.rnd.IntN(2) == 0
	e := eventFor(receiverProc, FaultReceiverDown)
	if refuse {
		e.Outcome = "refused"
		h.recv.refuse()
	} else {
		e.Outcome = "503"
		h.recv.set503(true)
	}
	h.record(e)
	err := sleepCtx(ctx, h.jitter(h.cfg.TTL, 0.5, 1.5))
	h.recv.set503(false)
	if aerr := h.recv.accept(context.WithoutCancel(ctx)); aerr != nil {
		return aerr
	}
	h.record(eventFor(receiverProc, markHeal))
	return err
}
