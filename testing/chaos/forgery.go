package chaos

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/history"
	"github.com/leasehold/leasehold/worker"
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

// forgeCopies sends, for a real effect of a job, an abort marker of the
// same job and attempt, and a final of a higher attempt with the real
// stamp, claiming one effect.
func (f *forger) forgeCopies(ctx context.Context, e seenEffect) {
	st := e.stamp
	st.Key = abortKey(st, e.mark.Job, e.mark.Attempt)
	abort := leasehold.JobMark{Job: e.mark.Job, Attempt: e.mark.Attempt, Abort: true}
	f.publish(ctx, forgedMsg(e.subject, st, abort, nil), ForgedAbortCopy, st, abort)

	f.mu.Lock()
	after := f.lastJob[chain{e.stamp.Partition, e.stamp.Epoch, e.stamp.Acquisition}]
	f.mu.Unlock()
	if after >= e.mark.Job {
		after = 0
	}
	final := leasehold.JobMark{Job: e.mark.Job, Attempt: min(e.mark.Attempt+1, leasehold.MaxAttempt), Effects: 1, After: after}
	f.publish(ctx, forgedMsg(e.subject, e.stamp, final, f.payload(ForgedFinalCopy)), ForgedFinalCopy, e.stamp, final)
}

// forgeAbortAhead sends abort markers with the largest attempt for the
// next jobs of a partition, before they run, under the stamp of its live
// holder. It prefers a partition whose holder publishes effects of jobs
// (marks they carry are the ones an abort closes).
func (f *forger) forgeAbortAhead(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	f.mu.Lock()
	var cands []seenEffect
	for _, e := range f.latest {
		cands = append(cands, e)
	}
	f.rnd.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	// A partition whose newest effect carries its job's marks is held by a
	// worker that marks every job (Job.Emit): its next job is one an abort
	// can close.
	slices.SortStableFunc(cands, func(a, b seenEffect) int {
		am, bm := f.progress[a.stamp.Partition] == a.mark.Job, f.progress[b.stamp.Partition] == b.mark.Job
		switch {
		case am && !bm:
			return -1
		case bm && !am:
			return 1
		}
		return 0
	})
	pick := f.rnd.IntN(f.h.cfg.Partitions)
	f.mu.Unlock()
	var st leasehold.Stamp
	for _, e := range cands {
		a, ok := f.holderOf(rctx, e.stamp.Partition)
		if ok && a.epoch == e.stamp.Epoch && a.token == e.stamp.Acquisition {
			st = e.stamp
			break
		}
	}
	if st.Scope == "" {
		a, ok := f.holderOf(rctx, leasehold.Partition(pick))
		if !ok {
			f.h.log.Info("chaos: forger: no holder to forge an abort ahead for", "partition", pick)
			return
		}
		st = leasehold.Stamp{Scope: prefix, Partition: a.p, Epoch: a.epoch, Acquisition: a.token, Worker: a.holder}
	}
	f.mu.Lock()
	progress := f.progress[st.Partition]
	f.mu.Unlock()
	jobs := f.jobsAhead(rctx, st.Partition, progress)
	if len(jobs) == 0 {
		f.h.log.Info("chaos: forger: no job ahead to forge an abort for", "partition", st.Partition)
	}
	for _, job := range jobs {
		mark := leasehold.JobMark{Job: job, Attempt: leasehold.MaxAttempt, Abort: true}
		st.Key = abortKey(st, job, mark.Attempt)
		f.publish(ctx, forgedMsg(worker.OutputSubject(prefix, st.Partition), st, mark, nil), ForgedAbortAhead, st, mark)
	}
}

// holderOf reads partition p's live lease from the lease bucket.
func (f *forger) holderOf(ctx context.Context, p leasehold.Partition) (seenAcq, bool) {
	e, err := f.kv.Get(ctx, "partition."+p.String())
	if err != nil {
		return seenAcq{}, false
	}
	var r leaseRecord
	if json.Unmarshal(e.Value(), &r) != nil || r.Token == "" {
		return seenAcq{}, false
	}
	epoch := r.Epoch
	if epoch == 0 {
		epoch = e.Revision()
	}
	return seenAcq{p: p, epoch: leasehold.Epoch(epoch), token: r.Token, holder: r.Holder}, true
}

// jobsAhead returns the next two jobs of partition p after job seq: those
// in the job stream, or, when none is there yet, the sequences the
// producer's round robin gives p next.
func (f *forger) jobsAhead(ctx context.Context, p leasehold.Partition, seq uint64) []uint64 {
	s, err := f.js.Stream(ctx, worker.JobsStream(prefix))
	if err != nil {
		f.h.log.Warn("chaos: forger: job stream", "err", err)
		return nil
	}
	var out []uint64
	for len(out) < 2 {
		m, err := s.GetMsg(ctx, seq+1, jetstream.WithGetMsgSubject(worker.JobSubject(prefix, p)))
		if err != nil {
			break
		}
		out, seq = append(out, m.Sequence), m.Sequence
	}
	if len(out) > 0 {
		return out
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.LastSeq == 0 {
		return nil
	}
	last, err := s.GetMsg(ctx, info.State.LastSeq)
	if err != nil {
		return nil
	}
	lp, err := leasehold.ParsePartition(last.Subject[strings.LastIndexByte(last.Subject, '.')+1:])
	if err != nil {
		return nil
	}
	n := uint64(f.h.cfg.Partitions)
	d := (uint64(p) + n - uint64(lp)) % n
	if d == 0 {
		d = n
	}
	next := info.State.LastSeq + d
	return []uint64{next, next + n}
}

// liveAcquisition is the acquisition of a partition with a live holder,
// read from the lease bucket now.
func (f *forger) liveAcquisition(ctx context.Context) (seenAcq, bool) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	f.mu.Lock()
	start := f.rnd.IntN(f.h.cfg.Partitions)
	f.mu.Unlock()
	for i := range f.h.cfg.Partitions {
		if a, ok := f.holderOf(rctx, leasehold.Partition((start+i)%f.h.cfg.Partitions)); ok {
			return a, true
		}
	}
	return seenAcq{}, false
}

// madeUpToken is an acquisition token no acquisition wrote, shaped as
// real ones are.
func (f *forger) madeUpToken() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var b [12]byte
	for i := range b {
		b[i] = byte(f.rnd.Uint32())
	}
	return hex.EncodeToString(b[:])
}

// forgeAcquisition sends, for partition a.p just acquired at a.epoch, an
// effect stamped with an epoch issued to another fence between a.p's
// previous epoch and a.epoch, then a barrier and an effect with a.epoch
// and a made-up acquisition token.
func (f *forger) forgeAcquisition(ctx context.Context, a seenAcq, lock seenAcq) {
	subject := worker.OutputSubject(prefix, a.p)
	if foreign, ok := f.foreignEpoch(ctx, a, lock); ok {
		st := leasehold.Stamp{Scope: prefix, Partition: a.p, Epoch: foreign.epoch, Acquisition: foreign.token,
			Key: fmt.Sprintf("%s.%d.forged-foreign.%d", prefix, a.p, f.nonce()), Worker: a.holder}
		f.publish(ctx, forgedMsg(subject, st, leasehold.JobMark{}, f.payload(ForgedForeignEpoch)), ForgedForeignEpoch, st, leasehold.JobMark{})
	}
	token := f.madeUpToken()
	st := leasehold.Stamp{Scope: prefix, Partition: a.p, Epoch: a.epoch, Acquisition: token,
		Key: leasehold.BarrierKey(prefix, a.p, a.epoch), Worker: a.holder}
	msg := forgedMsg(subject, st, leasehold.JobMark{}, nil)
	msg.Header.Set(leasehold.HeaderBarrier, "1")
	f.publish(ctx, msg, ForgedAcqBarrier, st, leasehold.JobMark{})
	st.Key = fmt.Sprintf("%s.%d.forged-acquisition.%d", prefix, a.p, f.nonce())
	f.publish(ctx, forgedMsg(subject, st, leasehold.JobMark{}, f.payload(ForgedAcqEffect)), ForgedAcqEffect, st, leasehold.JobMark{})
}

// fenceRecord is what the forger reads of a fence record: the epochs of
// the partition's latest acquisitions.
type fenceRecord struct {
	Epoch  uint64   `json:"epoch"`
	Recent []uint64 `json:"recent"`
}

// epochsOf returns the epochs partition p's fence record lists.
func (f *forger) epochsOf(ctx context.Context, p leasehold.Partition) []leasehold.Epoch {
	if f.fences == nil {
		return nil
	}
	e, err := f.fences.Get(ctx, "partition."+p.String())
	if err != nil {
		return nil
	}
	var r fenceRecord
	if json.Unmarshal(e.Value(), &r) != nil {
		return nil
	}
	var out []leasehold.Epoch
	for _, v := range append(r.Recent, r.Epoch) {
		if v != 0 {
			out = append(out, leasehold.Epoch(v))
		}
	}
	return out
}

// foreignEpoch is an acquisition of another fence (another partition, or
// the lock) whose epoch lies between a.p's epoch before a and a's. What
// the forger saw acquired comes first; the fence records fill in what it
// did not see.
func (f *forger) foreignEpoch(ctx context.Context, a, lock seenAcq) (seenAcq, bool) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	f.mu.Lock()
	var prev leasehold.Epoch
	for _, x := range f.acqs[a.p] {
		if x.epoch < a.epoch {
			prev = x.epoch
		}
	}
	f.mu.Unlock()
	if prev == 0 {
		for _, e := range f.epochsOf(rctx, a.p) {
			if e < a.epoch {
				prev = max(prev, e)
			}
		}
	}
	if prev == 0 {
		return seenAcq{}, false
	}
	recorded := map[leasehold.Partition][]leasehold.Epoch{}
	for q := range f.h.cfg.Partitions {
		if leasehold.Partition(q) != a.p {
			recorded[leasehold.Partition(q)] = f.epochsOf(rctx, leasehold.Partition(q))
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var cands []seenAcq
	for q, es := range recorded {
		for _, e := range es {
			if e > prev && e < a.epoch {
				// The token is not in the record the forger reads; it
				// copies the holder's, as if the acquisition were its.
				cands = append(cands, seenAcq{p: q, epoch: e, token: a.token, holder: a.holder})
			}
		}
	}
	if lock.epoch > prev && lock.epoch < a.epoch {
		cands = append(cands, lock)
	}
	for _, x := range f.allAcqs {
		if x.p != a.p && x.epoch > prev && x.epoch < a.epoch {
			cands = append(cands, x)
		}
	}
	if len(cands) == 0 {
		return seenAcq{}, false
	}
	return cands[f.rnd.IntN(len(cands))], true
}

// forgeMarkers is the fault's injection, from the nemesis.
func (h *harness) forgeMarkers(ctx context.Context) error {
	if h.forger == nil {
		return errors.New("the forger is not running")
	}
	h.forger.arm(ctx)
	return nil
}
