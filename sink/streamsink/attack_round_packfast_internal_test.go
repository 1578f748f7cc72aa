package streamsink

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/leasehold/leasehold"
)

// The one step (decidePacked) must decide as the way of groups does in the
// cases its random logs make rarely or never: a job applied under the
// other set of its keys, a job whose delivery went to the dead-letter
// stream, the same pack again, the held limits exactly at their edge, a
// chain that an effect of the batch left busy, a pack whose keys are part
// its own and part its origin's, and a pack after the fence record showed
// its lease commits no more of the job. Each log is decided both ways,
// message by message, and every outcome, error and the runner's state
// after each message must be the same; where the one step must be taken,
// it must be.
func TestAttackRoundPackedOneStepEdges(t *testing.T) {
	const p = leasehold.Partition(0)
	own := func(job uint64, n int) []string {
		keys := make([]string, n)
		for i := range keys {
			keys[i] = leasehold.EffectKey(packScope, p, job, i)
		}
		return keys
	}
	final := func(job uint64, n int, after uint64) leasehold.JobMark {
		return leasehold.JobMark{Job: job, Attempt: 1, Effects: n, After: after}
	}
	origin := leasehold.OriginOf(packScope, p, 2)
	originKeys := func(n int) []string {
		keys := make([]string, n)
		for i := range keys {
			keys[i] = origin.EffectKey(i)
		}
		return keys
	}
	type scenario struct {
		name    string
		log     func(l *packLog)
		setup   func(r *Runner) // after the log's message at hook
		hook    uint64
		held    int  // MaxHeldEffects, or the default
		proven  bool // the records of partition 0 read: jobs up to 3 of epoch 1 committed, as of position 6
		oneStep []uint64
	}
	for _, sc := range []scenario{{
		name: "applied under its origin's keys, then packed under its own",
		log: func(l *packLog) {
			l.packMsg(p, "out.0", 1, "a1", originKeys(3), final(5, 3, 0), leasehold.StampCompact, origin.String())
			l.packMsg(p, "out.0", 1, "a1", own(5, 3), final(5, 3, 0), leasehold.StampCompact, origin.String())
			l.packMsg(p, "out.0", 1, "a1", originKeys(3), final(5, 3, 0), leasehold.StampCompact, origin.String())
		},
		oneStep: []uint64{2},
	}, {
		name: "applied under its own keys, then packed under its origin's",
		log: func(l *packLog) {
			l.packMsg(p, "out.0", 1, "a1", own(5, 3), final(5, 3, 0), leasehold.StampCompact, "")
			l.packMsg(p, "out.0", 1, "a1", originKeys(3), final(5, 3, 0), leasehold.StampCompact, origin.String())
		},
		oneStep: []uint64{2},
	}, {
		name: "dead-lettered, then packed again",
		log: func(l *packLog) {
			l.packMsg(p, "out.0", 1, "a1", own(1, 2), final(1, 2, 0), leasehold.StampCompact, "")
			l.packMsg(p, "out.0", 1, "a1", own(1, 2), leasehold.JobMark{Job: 1, Attempt: 2, Effects: 2}, leasehold.StampCompact, "")
			l.packMsg(p, "out.0", 1, "a1", own(2, 3), final(2, 3, 1), leasehold.StampLegacy, "")
		},
		setup: func(r *Runner) {
			r.groups.addHole(groupKey{chainKey: chainKey{fence: leasehold.FenceID{Scope: packScope, Partition: p}, subject: "out.0"}, epoch: 1, acquisition: "a1", job: 1})
		},
		hook:    2,
		oneStep: []uint64{2, 4},
	}, {
		name: "the same pack twice, and after its job's next",
		log: func(l *packLog) {
			l.packMsg(p, "out.0", 1, "a1", own(1, 4), final(1, 4, 0), leasehold.StampCompact, "")
			l.add(l.msgs[1].subject, l.msgs[1].header, l.msgs[1].data)
			l.packMsg(p, "out.0", 1, "a1", own(2, 2), final(2, 2, 1), leasehold.StampCompact, "")
			l.add(l.msgs[1].subject, l.msgs[1].header, l.msgs[1].data)
		},
		oneStep: []uint64{2, 4},
	}, {
		name: "the held effects limit at its edge",
		log: func(l *packLog) {
			// One effect held open on out.1, then packs on out.0 of as
			// many effects as the limit leaves room for, and one more.
			l.effectMsg(p, "out.1", 1, "a1", own(1, 1)[0], leasehold.JobMark{Job: 1, Attempt: 1}, leasehold.StampCompact)
			l.packMsg(p, "out.0", 1, "a1", own(2, 3), final(2, 3, 0), leasehold.StampCompact, "")
			l.packMsg(p, "out.0", 1, "a1", own(3, 4), final(3, 4, 2), leasehold.StampCompact, "")
		},
		held:    4,
		oneStep: []uint64{3},
	}, {
		name: "a chain left busy by an effect before the pack",
		log: func(l *packLog) {
			l.effectMsg(p, "out.0", 1, "a1", own(1, 2)[0], leasehold.JobMark{Job: 1, Attempt: 1}, leasehold.StampCompact)
			l.packMsg(p, "out.0", 1, "a1", own(2, 3), final(2, 3, 1), leasehold.StampCompact, "")
			l.effectMsg(p, "out.0", 1, "a1", own(1, 2)[1], final(1, 2, 0), leasehold.StampCompact)
			l.packMsg(p, "out.0", 1, "a1", own(3, 2), final(3, 2, 2), leasehold.StampCompact, "")
		},
		oneStep: []uint64{5},
	}, {
		name: "keys part its own, part its origin's",
		log: func(l *packLog) {
			l.packMsg(p, "out.0", 1, "a1", []string{origin.EffectKey(0), own(5, 2)[1]}, final(5, 2, 0), leasehold.StampCompact, origin.String())
			l.packMsg(p, "out.0", 1, "a1", own(6, 2), final(6, 2, 5), leasehold.StampCompact, origin.String())
			l.packMsg(p, "out.0", 1, "a1", originKeys(2), final(5, 2, 0), leasehold.StampCompact, origin.String())
			l.packMsg(p, "out.0", 1, "a1", []string{own(5, 2)[0], origin.EffectKey(1)}, final(5, 2, 0), leasehold.StampCompact, origin.String())
		},
		oneStep: []uint64{2, 3},
	}, {
		name: "after the fence record showed its lease commits no more of the job",
		log: func(l *packLog) {
			for range 6 {
				l.effectMsg(p, "out.1", 1, "a1", "filler", leasehold.JobMark{}, leasehold.StampCompact)
			}
			l.packMsg(p, "out.0", 1, "a1", own(2, 2), final(2, 2, 0), leasehold.StampCompact, "")
			l.packMsg(p, "out.0", 1, "a1", own(4, 2), final(4, 2, 0), leasehold.StampCompact, "")
		},
		proven:  true,
		oneStep: []uint64{9},
	}} {
		t.Run(sc.name, func(t *testing.T) {
			// The log opens with an effect of no job that raises the
			// fence: a pack that raises it takes the way of groups.
			l := &packLog{}
			l.effectMsg(p, "out.9", 1, "a1", "opening", leasehold.JobMark{}, leasehold.StampCompact)
			sc.log(l)
			fast, slow := packRunner(0, sc.proven), packRunner(0, sc.proven)
			slow.packsOneByOne = true
			if sc.held > 0 {
				fast.cfg.MaxHeldEffects, slow.cfg.MaxHeldEffects = sc.held, sc.held
			}
			wf, ws := &work{}, &work{}
			ctx := context.Background()
			var taken []uint64
			for _, m := range l.msgs {
				var of, os []outcome
				var errF error
				if n, err := leasehold.PackCount(m.header); err == nil && n > 0 {
					var u unpacked
					if u.read(m, n) == nil && fast.decidePacked(wf, &u, &of) {
						taken = append(taken, m.seq)
					} else {
						errF = fast.decideLog(ctx, wf, m, &of)
					}
				} else {
					errF = fast.decideLog(ctx, wf, m, &of)
				}
				errS := slow.decideLog(ctx, ws, m, &os)
				where := fmt.Sprintf("log position %d", m.seq)
				if fmt.Sprint(errF) != fmt.Sprint(errS) {
					t.Fatalf("%s: one step: error %v; one by one: %v", where, errF, errS)
				}
				if errS != nil {
					t.Logf("%s: both ways: %v", where, errS)
					break
				}
				if got, want := describeOutcomes(of), describeOutcomes(os); !slices.Equal(got, want) {
					t.Fatalf("%s: outcomes differ\none step:\n%s\none by one:\n%s", where, join(got), join(want))
				}
				if got, want := describeRunner(fast, wf), describeRunner(slow, ws); got != want {
					t.Fatalf("%s: runner state differs\none step:   %s\none by one: %s", where, got, want)
				}
				wf.seq, ws.seq = m.seq, m.seq
				if sc.setup != nil && m.seq == sc.hook {
					sc.setup(fast)
					sc.setup(slow)
				}
			}
			if !slices.Equal(taken, sc.oneStep) {
				t.Fatalf("packs at %v decided in one step, want %v", taken, sc.oneStep)
			}
		})
	}
}
