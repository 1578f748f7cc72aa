package chaos

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
)

// Delivery is one request the HTTP receiver took.
type Delivery struct {
	// Arrival orders the request's arrival, before the Verifier judged
	// it; Handled orders its handler's run (0: the Verifier, or the
	// receiver being down, answered instead). One sequence numbers both.
	Arrival uint64 `json:"arrival"`
	Handled uint64 `json:"handled,omitempty"`
	// Status is the answer.
	Status int    `json:"status"`
	Key    string `json:"idempotency_key,omitempty"`
	// Stamp is the effect's stamp and Relay the relay's, as the request
	// carried them (zero when missing or malformed).
	Stamp leasehold.Stamp `json:"stamp"`
	Relay leasehold.Lease `json:"relay"`
	// Body is what the handler was given.
	Body string    `json:"body,omitempty"`
	Time time.Time `json:"t"`
	// Down says the receiver was down and answered 503 itself.
	Down bool `json:"down,omitempty"`
	// Replayed says the Verifier answered from its key store.
	Replayed bool `json:"replayed,omitempty"`
	// Refusal is a Verifier's refusal: its error code and fence
	// ("stale_epoch/relay").
	Refusal string `json:"refusal,omitempty"`
}

// HTTPFigures are what the HTTP receiver took, and the checker's counts
// of it. A job is applied there when the receiver's handler ran for its
// key: the Verifier in front of it answers a repeat of a key from its
// store without the handler.
type HTTPFigures struct {
	// Requests counts every request the receiver took; Handled those its
	// handler ran for; Replayed those the Verifier answered as a repeat of
	// a key already handled; StaleRelayRefused those it refused because a
	// newer relay's epoch was recorded (409); DownAnswers the 503s of the
	// receiver being down (connections it refused are not requests);
	// OtherRefused every other answer that was not 2xx.
	Requests          int `json:"requests"`
	Handled           int `json:"handled"`
	Replayed          int `json:"replayed"`
	StaleRelayRefused int `json:"stale_relay_refused"`
	DownAnswers       int `json:"down_answers"`
	OtherRefused      int `json:"other_refused"`

	JobsEnqueued int `json:"jobs_enqueued"`
	// JobsApplied counts the jobs whose effect was handled exactly once.
	JobsApplied int `json:"jobs_applied_once"`
	// JobsLost counts the jobs whose effect was never handled (the relays'
	// runner dead-lettered it, or it never came).
	JobsLost       int `json:"jobs_lost"`
	JobsDuplicated int `json:"jobs_duplicated"`
	// JobsDeadLettered counts the jobs the workers dead-lettered: they
	// have no effect to send. RelayDeadLettered counts the effects the
	// relays' runner dead-lettered, of jobs or injected: mostly a job's
	// effect re-run by a successor with another body (the chaos handler
	// writes its worker and epoch into it), which the Verifier answers
	// with 422 once the first body was handled. Only a job's effect never
	// handled is lost.
	JobsDeadLettered  int `json:"jobs_dead_lettered"`
	RelayDeadLettered int `json:"relay_dead_lettered"`
	// Stale counts requests handled that a fence had to refuse: a zombie's
	// effect from behind its successor's barrier, or a request of a relay
	// whose epoch a newer relay had superseded at the receiver.
	Stale int `json:"stale"`
	// ForgedResidual and JobsDisplaced are the KV figures' namesakes:
	// forged copies of a live holder's exact stamp handled, and the jobs
	// whose key such a copy took first.
	ForgedResidual int `json:"forged_handled_at_holder_stamp"`
	JobsDisplaced  int `json:"jobs_displaced_by_forgery"`
}

// checkHTTP is check (f), when the run had an HTTP destination: at the
// receiver, every job's effect handled exactly once, none lost; no request
// handled whose effect a fence must refuse (behind a newer barrier of its
// partition, or never in the effect log under its epoch), nor of a job
// attempt that did not complete; no request handled from a relay below
// the highest relay epoch the receiver had handled before it arrived; and
// nothing handled that no job produced, but forged copies of a holder's
// exact stamp (ForgedResidual).
func (c *checker) checkHTTP() {
	if c.in.HTTP == nil {
		return
	}
	f := &c.out.HTTP
	f.RelayDeadLettered = len(c.in.RelayDeadLettered)
	relayDead := map[string]bool{}
	for _, k := range c.in.RelayDeadLettered {
		relayDead[k] = true
	}
	ds := slices.Clone(c.in.HTTP)
	sort.SliceStable(ds, func(i, j int) bool { return ds[i].Arrival < ds[j].Arrival })
	handled := map[string][]Delivery{}
	for _, d := range ds {
		f.Requests++
		switch {
		case d.Handled != 0:
			f.Handled++
			handled[d.Stamp.Key] = append(handled[d.Stamp.Key], d)
		case d.Down:
			f.DownAnswers++
		case d.Replayed:
			f.Replayed++
		case d.Refusal == "stale_epoch/relay":
			f.StaleRelayRefused++
		default:
			f.OtherRefused++
		}
	}
	c.checkRelayOrder(ds)

	injected := map[string]Event{}
	for _, e := range c.injected {
		if e.Key != "" {
			injected[e.Key] = e
		}
	}
	jobs := c.jobSet()
	keys := make([]string, 0, len(handled))
	for k := range handled {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		for _, d := range handled[k] {
			c.judgeHTTP(d, jobs, injected)
		}
	}
	f.JobsEnqueued = len(jobs)
	jkeys := make([]string, 0, len(jobs))
	for k := range jobs {
		jkeys = append(jkeys, k)
	}
	sort.Strings(jkeys)
	dead := map[string]bool{}
	for _, j := range c.in.DeadLettered {
		dead[leasehold.EffectKey(c.in.Prefix, j.Partition, j.Seq, 0)] = true
	}
	for _, k := range jkeys {
		j, hs := jobs[k], handled[k]
		switch {
		case len(hs) > 1:
			f.JobsDuplicated++
			c.violate(Violation{Check: CheckHTTPDuplicate, Partition: j.Partition, Key: k,
				Detail: fmt.Sprintf("the receiver's handler ran %d times for this key: %s", len(hs), describeDeliveries(hs))})
		case len(hs) == 1 && forgedVariant([]byte(hs[0].Body)) != "":
			f.JobsDisplaced++
		case len(hs) == 1:
			f.JobsApplied++
		case dead[k]:
			f.JobsDeadLettered++
		default:
			f.JobsLost++
			why := "no request of it was handled"
			if relayDead[k] {
				why = "the relays' runner moved it to its dead-letter stream"
			}
			c.violate(Violation{Check: CheckHTTPLost, Partition: j.Partition, Key: k, Detail: "job " + j.ID + "'s effect never reached the receiver's handler: " + why})
		}
	}
}

// jobSet is every job, by the key of its effect: the job stream's and
// those the producer saw stored.
func (c *checker) jobSet() map[string]Job {
	jobs := map[string]Job{}
	for _, j := range c.in.Jobs {
		jobs[leasehold.EffectKey(c.in.Prefix, j.Partition, j.Seq, 0)] = j
	}
	for _, e := range c.in.Events {
		if e.Kind != KindEnqueue {
			continue
		}
		k := leasehold.EffectKey(c.in.Prefix, leasehold.Partition(e.Partition), e.Seq, 0)
		if _, ok := jobs[k]; !ok {
			jobs[k] = Job{Partition: leasehold.Partition(e.Partition), Seq: e.Seq, ID: e.JobID}
		}
	}
	return jobs
}

// judgeHTTP judges one request the handler ran for: what it carried must
// be an effect a fence admits, of a completed attempt, or a forged copy
// of a holder's exact stamp.
func (c *checker) judgeHTTP(d Delivery, jobs map[string]Job, injected map[string]Event) {
	st := d.Stamp
	v := Violation{Partition: st.Partition, Epoch: st.Epoch, Key: st.Key}
	if inj, ok := injected[st.Key]; ok {
		if inj.Reason == FaultForgedMarker && copiesHolderStamp(inj.Outcome) || inj.Reason == FaultGarbage && strings.HasSuffix(st.Key, "*") {
			// The garbage variant with a key no KV bucket takes copies
			// the newest stamp of the log, its holder's.
			c.out.HTTP.ForgedResidual++
			return
		}
		v.Check, v.Detail = CheckHTTPUnexpected, fmt.Sprintf("the receiver handled the %s message injected at log position %d (%s)", inj.Reason, inj.Position, describeDeliveries([]Delivery{d}))
		c.violate(v)
		return
	}
	if _, ok := jobs[st.Key]; !ok {
		v.Check, v.Detail = CheckHTTPUnexpected, "the receiver handled an effect no job produced: "+describeDeliveries([]Delivery{d})
		c.violate(v)
		return
	}
	if variant := forgedVariant([]byte(d.Body)); variant != "" {
		if copiesHolderStamp(variant) {
			c.out.HTTP.ForgedResidual++
			return
		}
		v.Check, v.Detail = CheckHTTPUnexpected, "the receiver handled a forged "+variant+" payload: "+describeDeliveries([]Delivery{d})
		c.violate(v)
		return
	}
	idx := c.realEntries(st.Key, st.Epoch)
	if len(idx) == 0 {
		v.Check, v.Detail = CheckHTTPUnexpected, "the receiver handled an effect under an epoch that never wrote this key into the effect log: "+describeDeliveries([]Delivery{d})
		c.violate(v)
		return
	}
	allBehind, complete := true, false
	var tries []string
	for _, i := range idx {
		l := c.in.Log[i]
		allBehind = allBehind && c.behind[i]
		if l.Mark.Standalone() || l.BadMark || c.done[attemptKey{l.Stamp.Partition, l.Stamp.Epoch, l.Mark.Job, l.Mark.Attempt}] {
			complete = true
		} else {
			tries = append(tries, fmt.Sprintf("attempt %d at log position %d", l.Mark.Attempt, l.Position))
		}
	}
	if allBehind {
		c.out.HTTP.Stale++
		v.Check, v.Detail = CheckHTTPStale, fmt.Sprintf("the receiver handled an effect of epoch %d that reached the effect log (position %d) only behind a newer barrier: %s",
			st.Epoch, c.in.Log[idx[0]].Position, describeDeliveries([]Delivery{d}))
		c.violate(v)
		return
	}
	if !complete {
		v.Check, v.Detail = CheckHTTPIncomplete, "the receiver handled this effect, and no attempt of its job under its epoch completed: "+strings.Join(tries, "; ")
		c.violate(v)
	}
}

// checkRelayOrder: a request whose handler ran must carry a relay epoch at
// least as high as that of every request whose handler had run before it
// arrived (ds is in arrival order). The Verifier records a relay's epoch
// before the handler runs and judges a request after it arrives, so such
// a request was below the recorded epoch when it was judged: a paused
// relay that woke after its successor had delivered.
func (c *checker) checkRelayOrder(ds []Delivery) {
	type mark struct {
		seq     uint64
		handled bool
		i       int
	}
	var marks []mark
	for i, d := range ds {
		if d.Handled == 0 || d.Relay.Scope == "" {
			continue
		}
		marks = append(marks, mark{d.Arrival, false, i}, mark{d.Handled, true, i})
	}
	sort.Slice(marks, func(i, j int) bool { return marks[i].seq < marks[j].seq })
	top := map[string]int{} // relay scope -> index into ds of the highest epoch handled
	for _, m := range marks {
		d := ds[m.i]
		t, seen := top[d.Relay.Scope]
		if m.handled {
			if !seen || d.Relay.Epoch > ds[t].Relay.Epoch {
				top[d.Relay.Scope] = m.i
			}
			continue
		}
		if seen && d.Relay.Epoch < ds[t].Relay.Epoch {
			c.out.HTTP.Stale++
			c.violate(Violation{Check: CheckHTTPStale, Partition: d.Stamp.Partition, Epoch: d.Stamp.Epoch, Key: d.Stamp.Key,
				Detail: fmt.Sprintf("the receiver handled a request of relay %s at relay epoch %d, which arrived (#%d) after a request of relay %s at relay epoch %d was handled (#%d): %s",
					d.Relay.Holder, d.Relay.Epoch, d.Arrival, ds[t].Relay.Holder, ds[t].Relay.Epoch, ds[t].Handled, describeDeliveries([]Delivery{d}))})
		}
	}
}

func describeDeliveries(ds []Delivery) string {
	parts := make([]string, len(ds))
	for i, d := range ds {
		parts[i] = fmt.Sprintf("#%d at %s: epoch %d acquisition %s by %s, relay %s epoch %d, status %d",
			d.Arrival, d.Time.Format("15:04:05.000"), d.Stamp.Epoch, d.Stamp.Acquisition, d.Stamp.Worker, d.Relay.Holder, d.Relay.Epoch, d.Status)
	}
	return strings.Join(parts, "; ")
}
