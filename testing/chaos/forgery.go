package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/history"
)

// The forged-marker fault plays an attacker who holds a worker's
// credentials: it reads the effect log as it is written and the lease
// bucket, with plain nats.go, and publishes on the effect subjects copies
// of what it read, altered where they do harm if a sink believes them:
//
//   - an abort marker with a real effect's stamp and job headers (the same
//     job and attempt) while the job may still be running, and one with the
//     largest attempt number for a job just ahead of the partition's
//     progress, before that job runs (ForgedAbortCopy, ForgedAbortAhead);
//   - a final with an attempt above the real one, the real stamp (key
//     included) and a payload of its own, claiming one effect
//     (ForgedFinalCopy);
//   - a barrier and an effect with the live holder's epoch, read from the
//     lease bucket, and a made-up acquisition token (ForgedAcqBarrier,
//     ForgedAcqEffect), sent the moment the forger sees the acquisition, to
//     race the holder's own barrier;
//   - an effect of partition P stamped with an epoch the bucket issued to
//     another fence (a lock the forger takes for the purpose, or another
//     partition) between two of P's epochs, sent at the same moment
//     (ForgedForeignEpoch).
//
// Each pick of the fault sends the abort ahead at once and arms the rest:
// the copies go out when the next effect of a job that has not completed
// appears, the acquisitions with the next acquisition; what no event
// triggered within the arm window goes out then, from what was read last.
// Every message is recorded as an injection, with its variant in the
// event's Outcome. Forged payloads start with forgedPayloadPrefix, so that
// the checker tells a forged value in the sink from a job's own.

// Variants of the forged-marker fault: the Outcome of its injection
// events, and what a forged payload in the sink names.
const (
	ForgedAbortCopy    = "abort_copy"
	ForgedAbortAhead   = "abort_ahead"
	ForgedFinalCopy    = "final_copy"
	ForgedAcqBarrier   = "acquisition_barrier"
	ForgedAcqEffect    = "acquisition_effect"
	ForgedForeignEpoch = "foreign_epoch"
)

// forgedPayloadPrefix starts the payload of every effect the forger
// writes: "<prefix><variant> <n>".
var forgedPayloadPrefix = []byte("leasehold-chaos-forged ")

// forgedVariant returns the variant a payload names, or "".
func forgedVariant(data []byte) string {
	rest, ok := bytes.CutPrefix(data, forgedPayloadPrefix)
	if !ok {
		return ""
	}
	v, _, _ := bytes.Cut(rest, []byte(" "))
	return string(v)
}

// copiesHolderStamp reports whether a variant carries a stamp a live
// holder had (epoch and acquisition issued to the partition): if its
// payload reaches the sink that is the accepted residual of a credential
// that may publish effects. The other variants' stamps were never issued
// to their fence, and nothing of them may be admitted.
func copiesHolderStamp(variant string) bool {
	switch variant {
	case ForgedAbortCopy, ForgedAbortAhead, ForgedFinalCopy:
		return true
	}
	return false
}

// seenEffect is a real effect of a job, as the forger read it.
type seenEffect struct {
	subject string
	stamp   leasehold.Stamp
	mark    leasehold.JobMark
	at      time.Time
}

// seenAcq is an acquisition the forger read from the lease bucket.
type seenAcq struct {
	p      leasehold.Partition
	epoch  leasehold.Epoch
	token  string
	holder string
}

type chain struct {
	p           leasehold.Partition
	epoch       leasehold.Epoch
	acquisition string
}

// forger runs the forged-marker fault beside the nemesis.
type forger struct {
	h      *harness
	nc     *nats.Conn
	js     jetstream.JetStream
	kv     jetstream.KeyValue // the lease bucket
	fences jetstream.KeyValue // its fence records; nil if not found
	sub    *nats.Subscription
	wake   chan struct{}

	stop   context.CancelFunc
	wg     sync.WaitGroup
	closed sync.Once

	mu       sync.Mutex
	rnd      *rand.Rand
	n        uint64
	latest   map[leasehold.Partition]seenEffect // the newest effect of a job per partition
	progress map[leasehold.Partition]uint64     // the newest job whose effect was published, per partition
	unfinal  []seenEffect                       // effects of attempts not yet final, newest last
	lastJob  map[chain]uint64                   // the last job with a final per lease
	acqs     map[leasehold.Partition][]seenAcq  // acquisitions per partition, ascending
	allAcqs  []seenAcq                          // every acquisition, ascending by epoch
	copyArm  []time.Time                        // deadlines of armed copies
	acqArm   []acqArm                           // armed acquisition forgeries
	copyDue  []seenEffect                       // copies to send, triggered by an effect
	acqDue   []acqTask                          // acquisition forgeries to send
}

type acqArm struct {
	deadline time.Time
	lock     seenAcq // a lock's acquisition taken when armed; zero if none
}

type acqTask struct {
	acq  seenAcq
	lock seenAcq
}

// startForger connects the forger and starts reading the effect log and
// the lease bucket.
func (h *harness) startForger(ctx context.Context) (*forger, error) {
	nc, err := nats.Connect(h.srv.urls(), nats.Name("leasehold chaos forger"), nats.MaxReconnects(-1),
		nats.ReconnectWait(100*time.Millisecond), nats.Timeout(2*time.Second),
		nats.NoEcho()) // its own messages are not real effects
	if err != nil {
		return nil, fmt.Errorf("chaos: forger: connect: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	f := &forger{h: h, nc: nc, js: js, wake: make(chan struct{}, 1),
		rnd:    rand.New(rand.NewPCG(h.cfg.Seed^0x6f72676572, h.cfg.Seed)),
		latest: map[leasehold.Partition]seenEffect{}, progress: map[leasehold.Partition]uint64{}, lastJob: map[chain]uint64{},
		acqs: map[leasehold.Partition][]seenAcq{}}
	kctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if f.kv, err = js.KeyValue(kctx, leaseKV); err != nil {
		nc.Close()
		return nil, fmt.Errorf("chaos: forger: open the lease bucket: %w", err)
	}
	if f.fences, err = js.KeyValue(kctx, h.bucket.FenceBucket()); err != nil {
		h.log.Warn("chaos: forger: the fence records are not readable; epochs of other fences come from acquisitions seen", "err", err)
		f.fences = nil
	}
	if f.sub, err = nc.Subscribe(prefix+".out.*", f.onEffect); err != nil {
		nc.Close()
		return nil, fmt.Errorf("chaos: forger: subscribe to the effect subjects: %w", err)
	}
	rctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	f.stop = stop
	f.wg.Add(2)
	go func() { defer f.wg.Done(); f.watchLeases(rctx) }()
	go func() { defer f.wg.Done(); f.run(rctx) }()
	return f, nil
}

// close stops the forger; armed forgeries not sent by now are dropped.
func (f *forger) close() {
	if f == nil {
		return
	}
	f.closed.Do(func() {
		_ = f.sub.Unsubscribe()
		f.stop()
		f.wg.Wait()
		f.nc.Close()
	})
}

// onEffect reads one real message on an effect subject. Only effects of
// jobs matter: the harness's other injections carry no job headers.
func (f *forger) onEffect(m *nats.Msg) {
	if m.Header == nil {
		return
	}
	st, err := leasehold.StampFromHeader(m.Header)
	if err != nil {
		return
	}
	if forgedVariant(m.Data) != "" {
		return
	}
	mark, err := leasehold.JobMarkFromHeader(m.Header)
	f.mu.Lock()
	defer f.mu.Unlock()
	if seq, ok := jobOfKey(st); ok {
		f.progress[st.Partition] = max(f.progress[st.Partition], seq)
	}
	if err != nil || mark.Standalone() {
		return
	}
	e := seenEffect{subject: m.Subject, stamp: st, mark: mark, at: time.Now()}
	if !mark.Abort {
		f.latest[st.Partition] = e
	}
	if mark.Final() {
		c := chain{st.Partition, st.Epoch, st.Acquisition}
		f.lastJob[c] = max(f.lastJob[c], mark.Job)
		return
	}
	if mark.Abort {
		return
	}
	// An effect of an attempt that has not completed: the moment to
	// copy it.
	f.unfinal = append(f.unfinal, e)
	if len(f.unfinal) > 64 {
		f.unfinal = f.unfinal[len(f.unfinal)-64:]
	}
	if len(f.copyArm) > 0 {
		f.copyArm = f.copyArm[1:]
		f.copyDue = append(f.copyDue, e)
		f.poke()
	}
}

// jobOfKey is the job an effect key names, for keys of the form
// leasehold.EffectKey gives.
func jobOfKey(st leasehold.Stamp) (uint64, bool) {
	parts := strings.Split(st.Key, ".")
	if len(parts) != 4 || parts[0] != st.Scope || parts[1] != st.Partition.String() {
		return 0, false
	}
	seq, err := strconv.ParseUint(parts[2], 10, 64)
	if _, ierr := strconv.Atoi(parts[3]); err != nil || ierr != nil {
		return 0, false
	}
	return seq, true
}

func (f *forger) poke() {
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// leaseRecord is what the forger reads of a lease record: an acquiring
// write has no epoch, its revision is the epoch.
type leaseRecord struct {
	Holder string `json:"holder"`
	Token  string `json:"token"`
	Epoch  uint64 `json:"epoch"`
}

// watchLeases follows the partition records of the lease bucket, noting
// each acquisition, and triggers the armed acquisition forgeries.
func (f *forger) watchLeases(ctx context.Context) {
	for ctx.Err() == nil {
		w, err := f.kv.Watch(ctx, "partition.*")
		if err != nil {
			_ = sleepCtx(ctx, 500*time.Millisecond)
			continue
		}
		f.follow(ctx, w)
		_ = w.Stop()
	}
}

func (f *forger) follow(ctx context.Context, w jetstream.KeyWatcher) {
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-w.Updates():
			if !ok {
				return
			}
			if e == nil || e.Operation() != jetstream.KeyValuePut {
				continue
			}
			p, err := leasehold.ParsePartition(strings.TrimPrefix(e.Key(), "partition."))
			if err != nil {
				continue
			}
			var r leaseRecord
			if json.Unmarshal(e.Value(), &r) != nil || r.Token == "" || r.Epoch != 0 {
				continue // garbage, or a renewal
			}
			f.noteAcquisition(seenAcq{p: p, epoch: leasehold.Epoch(e.Revision()), token: r.Token, holder: r.Holder})
		}
	}
}

func (f *forger) noteAcquisition(a seenAcq) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if l := f.acqs[a.p]; len(l) > 0 && l[len(l)-1].epoch >= a.epoch {
		return // seen already (a watcher started again)
	}
	f.acqs[a.p] = append(f.acqs[a.p], a)
	f.allAcqs = append(f.allAcqs, a)
	if len(f.acqArm) > 0 {
		arm := f.acqArm[0]
		f.acqArm = f.acqArm[1:]
		f.acqDue = append(f.acqDue, acqTask{acq: a, lock: arm.lock})
		f.poke()
	}
}

// run sends what the events triggered, and what the arm window ran out
// for.
func (f *forger) run(ctx context.Context) {
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.wake:
		case <-tick.C:
		}
		now := time.Now()
		f.mu.Lock()
		copies, acqs := f.copyDue, f.acqDue
		f.copyDue, f.acqDue = nil, nil
		for len(f.copyArm) > 0 && now.After(f.copyArm[0]) {
			f.copyArm = f.copyArm[1:]
			if e, ok := f.newestJobEffect(); ok {
				copies = append(copies, e)
			}
		}
		var late []acqArm
		for len(f.acqArm) > 0 && now.After(f.acqArm[0].deadline) {
			late = append(late, f.acqArm[0])
			f.acqArm = f.acqArm[1:]
		}
		f.mu.Unlock()
		for _, e := range copies {
			f.forgeCopies(ctx, e)
		}
		for _, t := range acqs {
			f.forgeAcquisition(ctx, t.acq, t.lock)
		}
		for _, arm := range late {
			if a, ok := f.liveAcquisition(ctx); ok {
				f.forgeAcquisition(ctx, a, arm.lock)
			}
		}
	}
}

// newestJobEffect is the newest effect of a job the forger read, of any
// partition. f.mu is held.
func (f *forger) newestJobEffect() (seenEffect, bool) {
	var best seenEffect
	for _, e := range f.latest {
		if e.at.After(best.at) {
			best = e
		}
	}
	return best, !best.at.IsZero()
}

// arm is the fault's pick: the abort ahead goes out now, the rest when
// their moment comes.
func (f *forger) arm(ctx context.Context) {
	window := max(4*f.h.cfg.FaultGap, 2*f.h.cfg.TTL)
	lock := f.takeLock(ctx)
	f.mu.Lock()
	deadline := time.Now().Add(window)
	f.copyArm = append(f.copyArm, deadline)
	f.acqArm = append(f.acqArm, acqArm{deadline: deadline, lock: lock})
	f.mu.Unlock()
	f.forgeAbortAhead(ctx)
}

// takeLock takes and releases a lock on the lease bucket, as any holder of
// a worker's credentials may: its epoch is one the bucket issued to a fence
// other than every partition's.
func (f *forger) takeLock(ctx context.Context) seenAcq {
	c, err := coordinator.New(f.h.bucket, coordinator.Config{Worker: "chaos-forger", TTL: f.h.cfg.TTL, Logger: f.h.log})
	if err != nil {
		return seenAcq{}
	}
	lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	l, err := c.TryLock(lctx, "chaos-forger")
	if err != nil {
		f.h.log.Warn("chaos: forger: lock not taken", "err", err)
		return seenAcq{}
	}
	info := l.Info()
	_ = l.Release(lctx)
	return seenAcq{epoch: info.Epoch, token: info.Acquisition, holder: info.Holder}
}

func (f *forger) nonce() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
	return f.n<<20 | f.rnd.Uint64N(1<<20)
}

func (f *forger) payload(variant string) []byte {
	return fmt.Appendf(append([]byte(nil), forgedPayloadPrefix...), "%s %d", variant, f.nonce())
}

// publish stores msg in the effect log and records it as an injection.
func (f *forger) publish(ctx context.Context, msg *nats.Msg, variant string, st leasehold.Stamp, mark leasehold.JobMark) {
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ack, err := f.js.PublishMsg(pctx, msg)
	if err != nil {
		f.h.log.Warn("chaos: forged marker not stored", "variant", variant, "err", err)
		return
	}
	f.h.record(history.Event{Proc: effectProc, Reason: FaultForgedMarker, Outcome: variant, Partition: uint32(st.Partition),
		Epoch: uint64(st.Epoch), Key: st.Key, Seq: mark.Job, Attempt: mark.Attempt, Position: ack.Sequence})
}

func forgedMsg(subject string, st leasehold.Stamp, mark leasehold.JobMark, data []byte) *nats.Msg {
	msg := nats.NewMsg(subject)
	st.SetHeader(msg.Header)
	mark.SetHeader(msg.Header)
	msg.Data = data
	return msg
}

func abortKey(st leasehold.Stamp, job, attempt uint64) string {
	return fmt.Sprintf("%s.%d.%d.abort.%d", st.Scope, st.Partition, job, attempt)
}
