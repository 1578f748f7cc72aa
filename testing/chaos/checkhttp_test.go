package chaos

import (
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

// request records one request at the HTTP receiver: it arrives now, and
// when handled its handler runs right after (handled returns the
// delivery, for a test to place its handler run itself).
func (s *story) request(st leasehold.Stamp, relay leasehold.Epoch, holder string, handled bool) *Delivery {
	s.httpSeq++
	d := Delivery{Arrival: s.httpSeq, Stamp: st, Status: 200, Key: st.Scope + " " + st.Key,
		Relay: leasehold.Lease{Scope: "leases/chaos-relay", Epoch: relay, Acquisition: "r", Holder: holder}, Time: s.at(20)}
	if handled {
		s.httpSeq++
		d.Handled, d.Body = s.httpSeq, `{"job":"x"}`
	}
	s.in.HTTP = append(s.in.HTTP, d)
	return &s.in.HTTP[len(s.in.HTTP)-1]
}

// stamp is b's stamp of job seq's effect, as the log holds it.
func (s *story) stamp(seq uint64) leasehold.Stamp {
	return leasehold.Stamp{Scope: "chaos", Acquisition: "a", Partition: 0, Epoch: 20, Key: s.key(seq), Worker: "b"}
}

// A run where relay r1 delivered both jobs, a repeat of one was answered
// from the Verifier's keys, and the paused r0's late request was refused.
func TestCheckHTTPPassesAVerifiedRun(t *testing.T) {
	s := newStory()
	s.in.HTTP = []Delivery{}
	s.request(s.stamp(1), 100, "r1", true)
	s.request(s.stamp(2), 100, "r1", true)
	d := s.request(s.stamp(1), 100, "r1", false)
	d.Replayed = true
	d = s.request(s.stamp(2), 90, "r0", false)
	d.Status, d.Refusal = 409, "stale_epoch/relay"
	a := Check(s.in)
	if !a.OK() {
		t.Fatalf("violations: %v", a.Violations)
	}
	f := a.HTTP
	if f.JobsEnqueued != 2 || f.JobsApplied != 2 || f.Replayed != 1 || f.StaleRelayRefused != 1 || f.Handled != 2 || f.Requests != 4 {
		t.Fatalf("figures %+v", f)
	}
	// Two relays' requests in flight at once, judged in either order:
	// neither handler had run when the other arrived.
	s = newStory()
	s.in.HTTP = []Delivery{
		{Arrival: 1, Handled: 4, Stamp: s.stamp(1), Relay: leasehold.Lease{Scope: "leases/chaos-relay", Epoch: 90, Holder: "r0"}},
		{Arrival: 2, Handled: 3, Stamp: s.stamp(2), Relay: leasehold.Lease{Scope: "leases/chaos-relay", Epoch: 100, Holder: "r1"}},
	}
	if a := Check(s.in); !a.OK() {
		t.Fatalf("overlapping requests: %v", a.Violations)
	}
}

// A relay paused past its lock's TTL wakes and its request is handled
// after its successor's: a receiver without a Verifier does that.
func TestCheckHTTPFindsASupersededRelay(t *testing.T) {
	s := newStory()
	s.in.HTTP = []Delivery{}
	s.request(s.stamp(1), 100, "r1", true)
	s.request(s.stamp(2), 90, "r0", true)
	a := Check(s.in)
	if checks(a) != CheckHTTPStale || a.HTTP.Stale != 1 {
		t.Fatalf("violations %q, figures %+v", checks(a), a.HTTP)
	}
	if v := a.Violations[0].String(); !strings.Contains(v, "relay r0 at relay epoch 90") || !strings.Contains(v, "relay r1 at relay epoch 100") {
		t.Fatalf("violation: %s", v)
	}
}

// A zombie's effect behind its successor's barrier reaches the receiver:
// the relays' runner must have refused it.
func TestCheckHTTPFindsAZombieEffect(t *testing.T) {
	s := newStory()
	s.effect(13, "a", 10, 1) // in the log behind b's barrier; the KV sink refused it
	s.in.HTTP = []Delivery{}
	zombie := s.stamp(1)
	zombie.Epoch, zombie.Worker = 10, "a"
	s.request(zombie, 100, "r1", true)
	s.request(s.stamp(2), 100, "r1", true)
	a := Check(s.in)
	if checks(a) != CheckHTTPStale || a.HTTP.Stale != 1 {
		t.Fatalf("violations %q, figures %+v", checks(a), a.HTTP)
	}
	if !strings.Contains(a.Violations[0].String(), "behind a newer barrier") {
		t.Fatalf("violation: %s", a.Violations[0])
	}
}

// A key handled twice (a receiver without dedupe), and a job never
// handled because the relays dead-lettered it.
func TestCheckHTTPFindsDuplicatedAndLost(t *testing.T) {
	s := newStory()
	s.in.HTTP = []Delivery{}
	s.request(s.stamp(1), 100, "r1", true)
	s.request(s.stamp(1), 100, "r1", true)
	s.in.RelayDeadLettered = []string{s.key(2)}
	a := Check(s.in)
	if checks(a) != CheckHTTPDuplicate+","+CheckHTTPLost || a.HTTP.JobsDuplicated != 1 || a.HTTP.JobsLost != 1 || a.HTTP.JobsApplied != 0 {
		t.Fatalf("violations %q, figures %+v", checks(a), a.HTTP)
	}
	for _, v := range a.Violations {
		if v.Check == CheckHTTPLost && (v.Key != s.key(2) || !strings.Contains(v.Detail, "dead-letter")) {
			t.Fatalf("lost: %s", v)
		}
	}
	// A job the workers dead-lettered has no effect to deliver.
	s = newStory()
	delete(s.in.Final, s.key(2))
	s.in.DeadLettered = []Job{{Partition: 0, Seq: 2}}
	s.in.HTTP = []Delivery{}
	s.request(s.stamp(1), 100, "r1", true)
	if a := Check(s.in); !a.OK() || a.HTTP.JobsDeadLettered != 1 || a.HTTP.JobsApplied != 1 {
		t.Fatalf("violations %q, figures %+v", checks(a), a.HTTP)
	}
}

// An injected message handled at the receiver: garbage without a
// holder's stamp is a violation; no HTTP record at all judges nothing.
func TestCheckHTTPFindsInjectedAndSkipsWithoutReceiver(t *testing.T) {
	s := newStory()
	s.in.HTTP = []Delivery{}
	s.request(s.stamp(1), 100, "r1", true)
	s.request(s.stamp(2), 100, "r1", true)
	forged := leasehold.Stamp{Scope: "chaos", Partition: 0, Epoch: 1, Acquisition: "forged", Key: "chaos.forged.7", Worker: "forger"}
	s.ev(15, Event{Proc: effectProc, Kind: KindFault, Reason: FaultForged, Partition: 0, Epoch: 1, Key: forged.Key, Position: 99})
	s.request(forged, 100, "r1", true)
	if a := Check(s.in); checks(a) != CheckHTTPUnexpected {
		t.Fatalf("violations %q", checks(a))
	}
	s = newStory()
	if a := Check(s.in); !a.OK() || a.HTTP.Requests != 0 || a.HTTP.JobsEnqueued != 0 {
		t.Fatalf("without a receiver: violations %q, figures %+v", checks(a), a.HTTP)
	}
}
