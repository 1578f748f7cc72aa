package chaos

import (
	"context"
	"path/filepath"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/history"
)

// settle waits until every job in the job stream that was not
// dead-lettered has its effect in the sink, or until Settle runs out.
func (h *harness) settle(ctx context.Context) (bool, error) {
	deadline := time.Now().Add(h.cfg.Settle)
	for {
		missing, err := h.missing(ctx)
		if err == nil && missing == 0 {
			return true, nil
		}
		if time.Now().After(deadline) {
			h.log.Warn("chaos: the sink did not catch up", "missing", missing, "err", err)
			return false, nil
		}
		h.log.Info("chaos: waiting for the sink", "missing", missing, "err", err)
		if err := sleepCtx(ctx, 500*time.Millisecond); err != nil {
			return false, err
		}
	}
}

func (h *harness) missing(ctx context.Context) (int, error) {
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	jobs, err := readJobs(rctx, h.js, prefix)
	if err != nil {
		return -1, err
	}
	dead, err := readDeadLetters(rctx, h.js, prefix)
	if err != nil {
		return -1, err
	}
	final, _, err := readFinal(rctx, h.js, sinkKV)
	if err != nil {
		return -1, err
	}
	isDead := map[uint64]bool{}
	for _, d := range dead {
		isDead[d.Seq] = true
	}
	// The HTTP receiver counts too: a job is in once a handler ran for
	// its key (a forged copy of its stamp may have taken the key).
	n := 0
	for _, j := range jobs {
		k := leasehold.EffectKey(prefix, j.Partition, j.Seq, 0)
		if _, ok := final[k]; (!ok || !h.recv.delivered(k)) && !isDead[j.Seq] {
			n++
		}
	}
	return n, nil
}

// collect reads the histories and what the run left behind.
func (h *harness) collect(ctx context.Context) (Input, error) {
	rctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	in := Input{Prefix: prefix}
	var err error
	if in.Events, err = history.Read(h.histDir); err != nil {
		return in, err
	}
	err = retryUntil(rctx, func() (err error) {
		if in.Jobs, err = readJobs(rctx, h.js, prefix); err != nil {
			return err
		}
		if in.DeadLettered, err = readDeadLetters(rctx, h.js, prefix); err != nil {
			return err
		}
		if in.Log, err = readEffectLog(rctx, h.js, prefix); err != nil {
			return err
		}
		if in.Final, in.Forged, err = readFinal(rctx, h.js, sinkKV); err != nil {
			return err
		}
		in.RelayDeadLettered, err = readRelayDeadLetters(rctx, h.js)
		return err
	})
	in.HTTP = h.recv.deliveries()
	if werr := writeDeliveries(filepath.Join(h.dir, "http-receiver.jsonl"), in.HTTP); werr != nil {
		h.log.Warn("chaos: the receiver's record not written", "err", werr)
	}
	if in.Jobs == nil {
		in.Jobs = []Job{}
	}
	return in, err
}
