package streamsink

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// The runner decides a packed message that holds a whole attempt in one
// step (decidePacked) where it can, and effect by effect otherwise. The
// two ways must not differ: the same logs, of whole attempts, forged and
// odd ones among them, are decided by a runner that takes the one step
// and by one that never does, and every outcome, and the chains, groups
// and fences after each message, must be the same.
func TestDecidePackedOneStepAsOneByOne(t *testing.T) {
	t.Parallel()
	seeds := 400
	if testing.Short() {
		seeds = 60
	}
	var taken, packs int
	for seed := range seeds {
		tk, pk := comparePackedWays(t, uint64(seed))
		taken += tk
		packs += pk
		if t.Failed() {
			return
		}
	}
	// The logs must exercise both ways: a comparison of the slow way with
	// itself proves nothing.
	if taken == 0 || taken == packs {
		t.Fatalf("%d of %d packed messages decided in one step: the logs do not exercise both ways", taken, packs)
	}
	t.Logf("%d of %d packed messages decided in one step", taken, packs)
}

// packLog writes the log of one seed.
type packLog struct {
	rng   *rand.Rand
	seq   uint64
	msgs  []*logMsg
	epoch [3]leasehold.Epoch
	next  [3]uint64    // the next job, by partition
	after [3][2]uint64 // the last job completed, by partition and subject
}

const packScope = "shop"

func (l *packLog) add(subject string, h nats.Header, data []byte) {
	l.seq++
	l.msgs = append(l.msgs, &logMsg{seq: l.seq, subject: subject, header: h, data: data})
}

// effectMsg is an effect sent alone.
func (l *packLog) effectMsg(p leasehold.Partition, subject string, epoch leasehold.Epoch, acq, key string, mark leasehold.JobMark, form leasehold.StampFormat) {
	h := nats.Header{"Traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
	leasehold.Stamp{Scope: packScope, Partition: p, Epoch: epoch, Acquisition: acq, Key: key, Worker: "w1"}.SetHeaderAs(h, form)
	mark.SetHeaderAs(h, form)
	l.add(subject, h, []byte("alone "+key))
}

// packMsg is a packed message of keys, the last one's mark being mark.
func (l *packLog) packMsg(p leasehold.Partition, subject string, epoch leasehold.Epoch, acq string, keys []string, mark leasehold.JobMark, form leasehold.StampFormat, origin string) {
	var body []byte
	for i, k := range keys {
		eh := map[string][]string{"Traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0" + strconv.Itoa(i%10)}}
		if i%2 == 1 {
			eh["X-Kind"] = []string{"odd"}
		}
		body = leasehold.AppendPacked(body, leasehold.PackedEffect{Key: k, Header: eh, Data: []byte("effect " + k)})
	}
	h := nats.Header{}
	leasehold.Stamp{Scope: packScope, Partition: p, Epoch: epoch, Acquisition: acq, Key: keys[len(keys)-1], Worker: "w1"}.SetHeaderAs(h, form)
	mark.SetHeaderAs(h, form)
	leasehold.SetPackHeader(h, len(keys))
	if origin != "" {
		h[leasehold.HeaderOrigin] = []string{origin}
	}
	h[nats.MsgIdHdr] = []string{"x"}
	l.add(subject, h, body)
}

// step writes the next message or two: mostly whole attempts, and now
// and then one that is forged, odd, or takes the way of groups.
func (l *packLog) step() {
	r := l.rng
	p := leasehold.Partition(r.IntN(3))
	s := r.IntN(2)
	subject := "out." + strconv.Itoa(s)
	epoch := l.epoch[p]
	acq := "a" + strconv.FormatUint(uint64(epoch), 10)
	form := leasehold.StampCompact
	if r.IntN(6) == 0 {
		form = leasehold.StampLegacy
	}
	job := l.next[p]
	n := 2 + r.IntN(3)
	keys := make([]string, n)
	for i := range keys {
		keys[i] = leasehold.EffectKey(packScope, p, job, i)
	}
	mark := leasehold.JobMark{Job: job, Attempt: 1, Effects: n, After: l.after[p][s]}
	if r.IntN(5) == 0 {
		mark.Floored, mark.Floor = true, l.after[p][s]
	}
	origin := ""
	completes := true
	switch r.IntN(24) {
	case 0: // a key naming another job
		keys[r.IntN(n)] = leasehold.EffectKey(packScope, p, job+1, 0)
	case 1: // a key twice
		keys[0] = keys[n-1]
	case 2: // moved: the origin's keys
		o := leasehold.OriginOf(packScope, p, 1+r.Uint64N(job))
		if r.IntN(2) == 0 {
			o = leasehold.OriginOf(packScope, (p+1)%3, 100+r.Uint64N(50))
		}
		origin = o.String()
		for i := range keys {
			keys[i] = o.EffectKey(i)
		}
	case 3: // an origin that comes after the job: not the job's keys
		o := leasehold.OriginOf(packScope, p, job+10)
		origin = o.String()
		for i := range keys {
			keys[i] = o.EffectKey(i)
		}
	case 4: // attempt 0
		mark.Attempt = 0
	case 5: // a final that counts more than the message packs: the rest alone
		mark.Effects = n + 1
		l.packMsg(p, subject, epoch, acq, keys, mark, form, origin)
		if r.IntN(3) > 0 {
			l.effectMsg(p, subject, epoch, acq, leasehold.EffectKey(packScope, p, job, n), leasehold.JobMark{Job: job, Attempt: 1}, form)
		}
		l.next[p]++
		l.after[p][s] = job
		return
	case 6: // a job whose After is not settled yet
		mark.After = job + 1
		completes = false
	case 7: // a stale epoch
		if epoch > 1 {
			epoch--
			acq = "a" + strconv.FormatUint(uint64(epoch), 10)
		}
		completes = false
	case 8: // another acquisition of the epoch
		acq = "b"
		completes = false
	case 9: // the next lease
		l.epoch[p]++
		epoch = l.epoch[p]
		acq = "a" + strconv.FormatUint(uint64(epoch), 10)
		mark.After, mark.Floor = 0, 0
		l.after[p] = [2]uint64{}
	case 10: // a message of the log again
		if len(l.msgs) > 0 {
			m := l.msgs[r.IntN(len(l.msgs))]
			l.add(m.subject, m.header, m.data)
			return
		}
	case 11: // the job's next attempt, or an earlier job's
		if job > 1 && r.IntN(2) == 0 {
			job = 1 + r.Uint64N(job-1)
			for i := range keys {
				keys[i] = leasehold.EffectKey(packScope, p, job, i)
			}
			mark.Job = job
			completes = false
		}
		mark.Attempt = 2
	case 12: // an attempt's first effects alone, then its final packed
		l.effectMsg(p, subject, epoch, acq, keys[0], leasehold.JobMark{Job: job, Attempt: 1}, form)
		mark.Effects = n + 1
		keys = append(keys[1:], leasehold.EffectKey(packScope, p, job, n))
	case 13: // an abort marker of the attempt, then its final
		l.effectMsg(p, subject, epoch, acq, packScope+"."+p.String()+"."+strconv.FormatUint(job, 10)+".abort.1", leasehold.JobMark{Job: job, Attempt: 1, Abort: true}, form)
	case 14: // not a final
		mark = leasehold.JobMark{Job: job, Attempt: 1}
		completes = false
	case 15: // a job left open on the chain: later ones wait behind it
		l.effectMsg(p, subject, epoch, acq, keys[0], leasehold.JobMark{Job: job, Attempt: 1}, form)
		l.next[p]++
		return
	case 16: // a final naming a job far ahead
		mark.Job = job + 1000
		for i := range keys {
			keys[i] = leasehold.EffectKey(packScope, p, mark.Job, i)
		}
		completes = false
	}
	l.packMsg(p, subject, epoch, acq, keys, mark, form, origin)
	if completes {
		l.next[p]++
		l.after[p][s] = job
	}
}

// packRunner is a runner without NATS: decideLog alone, as the benchmark
// drives it.
func packRunner(seed uint64, proven bool) *Runner {
	cfg := Config{Prefix: "t", Logger: slog.New(slog.DiscardHandler)}
	cfg.setDefaults()
	switch seed % 5 {
	case 1:
		cfg.MaxHeldEffects = 4
	case 2:
		cfg.MaxHeldBytes = 1200
	}
	r := &Runner{cfg: cfg, rep: sink.NewReporter(sink.ReporterConfig{Name: "t", Logger: cfg.Logger}), fences: newFenceTable(numShards), groups: newGroups()}
	if proven {
		// Records read: partition 0 committed up to job 3 in epoch 1,
		// read as of log position 6.
		r.proofs = &proofs{known: map[leasehold.FenceID]proof{
			{Scope: packScope, Partition: 0}: {p: sink.Progress{Epoch: 1, Acquisition: "a1", Seq: 3}, at: 6},
		}}
	}
	return r
}

// comparePackedWays decides the log of seed both ways, message by message,
// and compares. It returns how many packed messages took the one step,
// and how many there were.
func comparePackedWays(t *testing.T, seed uint64) (taken, packs int) {
	t.Helper()
	l := &packLog{rng: rand.New(rand.NewPCG(seed, 7)), epoch: [3]leasehold.Epoch{1, 1, 1}, next: [3]uint64{1, 1, 1}}
	for len(l.msgs) < 80 {
		l.step()
	}
	proven := seed%3 == 0
	fast, slow := packRunner(seed, proven), packRunner(seed, proven)
	slow.packsOneByOne = true
	wf, ws := &work{}, &work{}
	ctx := context.Background()
	for _, m := range l.msgs {
		var of, os []outcome
		// The fast runner: the one step first, where it applies, and
		// decideLog otherwise (which tries it again, and falls back).
		var errF error
		oneStep, packed := false, false
		if n, err := leasehold.PackCount(m.header); err == nil && n > 0 {
			packs++
			packed = true
			var p unpacked
			if p.read(m, n) == nil && fast.decidePacked(wf, &p, &of) {
				taken++
				oneStep = true
			} else {
				errF = fast.decideLog(ctx, wf, m, &of)
			}
		} else {
			errF = fast.decideLog(ctx, wf, m, &of)
		}
		errS := slow.decideLog(ctx, ws, m, &os)
		where := fmt.Sprintf("seed %d, log position %d", seed, m.seq)
		if fmt.Sprint(errF) != fmt.Sprint(errS) {
			t.Fatalf("%s: one step: error %v; one by one: %v", where, errF, errS)
		}
		if errS != nil {
			// The batch is decided again from the saved position: the
			// log ends here for this comparison.
			return taken, packs
		}
		if !sameOutcomes(of, os) {
			compareOutcomes(t, where, of, os, oneStep)
		}
		// Both runners decide any other message the same way, from states
		// checked equal after the last packed one: only where the ways
		// part can the states differ.
		if !packed && m != l.msgs[len(l.msgs)-1] {
			wf.seq, ws.seq = m.seq, m.seq
			continue
		}
		if got, want := describeRunner(fast, wf), describeRunner(slow, ws); got != want {
			t.Fatalf("%s: runner state differs\none step:   %s\none by one: %s", where, got, want)
		}
		wf.seq, ws.seq = m.seq, m.seq
	}
	return taken, packs
}

// compareOutcomes fails t unless of and os, which sameOutcomes found
// unlike, differ only in an order the one by one way may take.
func compareOutcomes(t *testing.T, where string, of, os []outcome, oneStep bool) {
	t.Helper()
	got, want := describeOutcomes(of), describeOutcomes(os)
	if !slices.Equal(got, want) && !oneStep {
		// A stamp that raises a fence settles the earlier leases'
		// groups lane by lane, in the order of a map: the same
		// outcomes, in another order. The one step raises nothing,
		// and its outcomes come in one order.
		slices.Sort(got)
		slices.Sort(want)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("%s: outcomes differ\none step:\n%s\none by one:\n%s", where, join(got), join(want))
	}
}

func join(s []string) string {
	out := ""
	for _, x := range s {
		out += "  " + x + "\n"
	}
	return out
}

// sameOutcomes reports whether a and b are alike in order and in
// everything describeOutcomes spells out, without spelling it: most
// messages' are, and spelling them all is most of the test's time.
func sameOutcomes(a, b []outcome) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := a[i], b[i]
		if x.m.seq != y.m.seq || x.m.subject != y.m.subject || (x.m.msg != nil) != (y.m.msg != nil) ||
			!bytes.Equal(x.m.data, y.m.data) || !sameHeader(x.m.header, y.m.header) ||
			x.report != y.report || x.deliver != y.deliver || x.term != y.term || x.job != y.job ||
			fmt.Sprint(x.refile) != fmt.Sprint(y.refile) || fmt.Sprint(x.d.Err) != fmt.Sprint(y.d.Err) {
			return false
		}
		dx, dy := x.d, y.d
		dx.Err, dy.Err = nil, nil
		if dx != dy {
			return false
		}
	}
	return true
}

func sameHeader(a, b nats.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		w, ok := b[k]
		if !ok || !slices.Equal(v, w) {
			return false
		}
	}
	return true
}

// describeOutcomes spells out outcomes, with everything of them a
// decision or a delivery reads.
func describeOutcomes(outs []outcome) []string {
	var s []string
	for _, o := range outs {
		d := o.d
		errS, refile := "", ""
		if d.Err != nil {
			errS = d.Err.Error()
		}
		if o.refile != nil {
			refile = o.refile.Error()
		}
		d.Err = nil
		s = append(s, fmt.Sprintf("seq=%d subject=%s acked=%v header=%v data=%q report=%v deliver=%v term=%v job=%d refile=%q decision=%+v err=%q",
			o.m.seq, o.m.subject, o.m.msg != nil, sortedHeader(o.m.header), o.m.data, o.report, o.deliver, o.term, o.job, refile, d, errS))
	}
	return s
}

func sortedHeader(h nats.Header) string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	out := ""
	for _, k := range keys {
		out += fmt.Sprintf("%s=%q;", k, h[k])
	}
	return out
}

// describeRunner spells out what the runner keeps between messages: the
// chains, the open groups, what they hold, and the fences.
func describeRunner(r *Runner, w *work) string {
	gs := r.groups
	var chains []string
	for c, a := range gs.applied {
		chains = append(chains, fmt.Sprintf("%v:%+v", c, a))
	}
	slices.Sort(chains)
	var delta []string
	for c, a := range gs.delta {
		delta = append(delta, fmt.Sprintf("%v:%+v", c, a))
	}
	slices.Sort(delta)
	var open []string
	for k, g := range gs.open {
		var atts []string
		for _, a := range g.atts {
			atts = append(atts, fmt.Sprintf("%d@%d:%d held %d bytes final %+v %q", a.n, a.first, len(a.held), a.bytes, a.final, a.finalKey))
		}
		open = append(open, fmt.Sprintf("%v first %d closed %v %v", k, g.first, g.closed, atts))
	}
	slices.Sort(open)
	var busy []string
	for c, n := range gs.busy {
		busy = append(busy, fmt.Sprintf("%v:%d", c, n))
	}
	slices.Sort(busy)
	var lanes []string
	for k, l := range gs.lanes {
		lanes = append(lanes, fmt.Sprintf("%v:%v", k, l.jobs))
	}
	slices.Sort(lanes)
	var raised []string
	for id, f := range w.raised {
		raised = append(raised, fmt.Sprintf("%v:%+v", id, f))
	}
	slices.Sort(raised)
	soon := false
	if r.proofs != nil {
		soon = r.proofs.soon
	}
	return fmt.Sprintf("chains %v delta %v open %v busy %v lanes %v held %d bytes %d above %d overflow %v grouped %v raised %v soon %v",
		chains, delta, open, busy, lanes, gs.held, gs.bytes, gs.above, gs.overflow, w.grouped, raised, soon)
}

// Each effect of a packed message carries the stamp and the mark it would
// carry alone: in the compact form, its key in the message's stamp, and the
// plain mark of the job and attempt, cut from the message's mark.
func TestPackedCompactHeadersAsAlone(t *testing.T) {
	for _, mark := range []leasehold.JobMark{
		{Job: 7, Attempt: 1},
		{Job: 7, Attempt: 3, Effects: 3, After: 6},
		{Job: 1 << 62, Attempt: 1 << 52, Effects: 4096, After: 1<<62 - 1, Floored: true, Floor: 1 << 61},
		{Job: 12, Attempt: 2, Effects: 9, After: 0, Floored: true},
	} {
		l := &packLog{}
		keys := []string{leasehold.EffectKey(packScope, 3, mark.Job, 0), "other-key", leasehold.EffectKey(packScope, 3, mark.Job, 2)}
		l.packMsg(3, "out.0", 4, "a4", keys, mark, leasehold.StampCompact, "")
		var p unpacked
		if err := p.read(l.msgs[0], len(keys)); err != nil {
			t.Fatalf("mark %+v: %v", mark, err)
		}
		for i, e := range p.effects {
			want := leasehold.JobMark{Job: mark.Job, Attempt: mark.Attempt}
			if i == len(keys)-1 {
				want = mark
			}
			h := nats.Header{}
			leasehold.Stamp{Scope: packScope, Partition: 3, Epoch: 4, Acquisition: "a4", Key: keys[i], Worker: "w1"}.SetHeaderAs(h, leasehold.StampCompact)
			want.SetHeaderAs(h, leasehold.StampCompact)
			for _, name := range []string{leasehold.HeaderStamp, leasehold.HeaderMark} {
				if got := e.m.header[name]; !slices.Equal(got, h[name]) || cap(got) != 1 {
					t.Errorf("mark %+v, effect %d: %s %q (capacity %d), want %q alone", mark, i, name, got, cap(got), h[name])
				}
			}
			if e.mark != want || e.stamp.Key != keys[i] {
				t.Errorf("mark %+v, effect %d: read as %+v, key %q; want %+v, %q", mark, i, e.mark, e.stamp.Key, want, keys[i])
			}
		}
	}
}
