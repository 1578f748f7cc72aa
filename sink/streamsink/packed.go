package streamsink

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
)

// A packed message (leasehold.HeaderPack) carries several effects of one
// attempt on one subject: a worker sends them as one log message, so that
// the runner fetches, acks and positions one message where it would have
// done as many. The runner expands it, in log order, into the effects it
// holds, each as the worker would have sent it alone: the message's
// subject, the effect's own headers and data, its own stamp (the
// message's, with the effect's key, in the message's form), the message's
// job mark on the last effect and the plain mark of the job and attempt on
// the others (in the message's form), and the message's
// leasehold.HeaderOrigin. Each is then decided as any effect is (its
// fence, its job's group), all at the message's log position: positions
// that decisions, dead letters and the saved position name are the
// message's (sink.Decision.Position of each of its effects is the
// message's position; their keys tell them apart). The message is acked,
// or terminated, once, when the last of its effects is decided, and the
// position moves past it only then.
//
// A packed message that breaks the form (see leasehold.HeaderPack: a
// count, a length or a key that does not hold, an effect header that is
// leasehold's or the server's), whose last key is not its stamp's, that
// is a barrier, an abort marker or carries no job mark, or whose final
// counts fewer effects than it packs, is malformed as a whole: refused as
// sink.BadStamp, terminated and reported, and none of it applied. Nothing
// else about a packed message is judged apart from its effects: an effect
// whose key names another job is set aside (SuspectJobKey) as it would be
// alone.

// decideLog decides log message m and appends its outcomes to outs: one
// for a message that stands for one effect (or barrier, or marker), and
// one per effect for a packed message. An error means the decision could
// not be taken, and m is decided again later; effects of a packed message
// decided before it are found again then (an effect its attempt holds
// already is not held twice, and a job applied is a duplicate).
func (r *Runner) decideLog(ctx context.Context, w *work, m *logMsg, outs *[]outcome) error {
	n, err := leasehold.PackCount(m.header)
	if err == nil && n == 0 {
		o, err := r.decide(ctx, w, m, outs)
		if err != nil {
			return err
		}
		*outs = append(*outs, o)
		return nil
	}
	var p unpacked
	if err == nil {
		err = p.read(m, n)
	}
	if err != nil {
		*outs = append(*outs, r.badStamp(m, p.stamp, fmt.Errorf("%w: a packed message (%s): %w", leasehold.ErrBadStamp, leasehold.HeaderPack, err)))
		return nil
	}
	if r.decidePacked(w, &p, outs) {
		return nil
	}
	for i := range p.effects {
		e := &p.effects[i]
		o, err := r.decideStamped(ctx, w, &e.m, e.stamp, false, &e.mark, outs)
		if err != nil {
			return err
		}
		// A packed effect is never a replayed dead letter (a replay is
		// one effect alone, and a dead letter never packed): one that
		// says it is, refused, is not filed again as a dead letter. Filed,
		// one message of a forger's made as many as it packs.
		o.refile = nil
		*outs = append(*outs, o)
	}
	return nil
}

// unpacked is a packed message read and checked.
type unpacked struct {
	stamp   leasehold.Stamp // the message's: its last effect's
	effects []unpackedEffect
}

// unpackedEffect is one effect of a packed message, as the worker would
// have sent it alone.
type unpackedEffect struct {
	m     logMsg
	stamp leasehold.Stamp
	mark  leasehold.JobMark
	// vals are its compact stamp and mark, where the message carries
	// them: its header's values, which come with it.
	vals [2]string
}

var (
	errPackBarrier    = errors.New("is a barrier: a barrier is never packed")
	errPackStandalone = errors.New("carries no job mark: only effects of a job's attempt are packed")
	errPackAbort      = errors.New("is an abort marker: an abort marker is never packed")
)

// read checks packed message m of n effects and expands it.
func (p *unpacked) read(m *logMsg, n int) error {
	st, err := leasehold.StampFromHeader(m.header)
	if err != nil {
		return err
	}
	p.stamp = st
	if _, barrier := headerGet(m.header, leasehold.HeaderBarrier); barrier {
		return errPackBarrier
	}
	mark, err := leasehold.JobMarkFromHeader(m.header)
	switch {
	case err != nil:
		return err
	case mark.Standalone():
		return errPackStandalone
	case mark.Abort:
		return errPackAbort
	case mark.Final() && mark.Effects < n:
		return fmt.Errorf("is its attempt's final, counting %d effects on the subject, and packs %d", mark.Effects, n)
	}
	entries, err := leasehold.Unpack(m.data, n)
	if err != nil {
		return err
	}
	if last := entries[n-1].Key; last != st.Key {
		return fmt.Errorf("its last effect's key %q is not its stamp's %q: the stamp of a packed message is its last effect's", last, st.Key)
	}
	// The message's origin, which each of its effects carries: one slice,
	// full, so that an append to one effect's copy is its own.
	origin := headerValues(m.header, leasehold.HeaderOrigin)
	origin = origin[:len(origin):len(origin)]
	p.effects = make([]unpackedEffect, n)
	stamps, marks := compact(m, entries, st, p.effects)
	plain := leasehold.JobMark{Job: mark.Job, Attempt: mark.Attempt}
	for i := range entries {
		e := &entries[i]
		// The entry's header map is Unpack's, fresh: the effect's own.
		h := nats.Header(e.Header)
		if h == nil {
			h = make(nats.Header, 3)
		}
		if origin != nil {
			deleteFold(h, leasehold.HeaderOrigin)
			h[leasehold.HeaderOrigin] = origin
		}
		u := &p.effects[i]
		u.stamp, u.mark = st, plain
		u.stamp.Key = e.Key
		if i == n-1 {
			u.mark = mark
		}
		// The entry's headers hold no stamp or mark header (Unpack
		// refuses them): the compact ones are set without a search.
		if stamps {
			h[leasehold.HeaderStamp] = u.vals[0:1:1]
		} else {
			u.stamp.SetHeader(h)
		}
		if marks {
			h[leasehold.HeaderMark] = u.vals[1:2:2]
		} else {
			u.mark.SetHeaderAs(h, leasehold.StampLegacy)
		}
		u.m = logMsg{seq: m.seq, subject: m.subject, header: h, data: e.Data}
	}
	// The message is acked, or terminated, once: with its last effect.
	p.effects[n-1].m.msg = m.msg
	return nil
}

// compact sets the values of the compact stamp and mark headers of the
// effects of packed message m, whose entries were read, in their vals:
// each only when m carries that header in the compact form (the legacy
// form is written per effect), and reports which it set. The last
// effect's are m's own; the others' are parts of m's and of one string.
func compact(m *logMsg, entries []leasehold.PackedEffect, st leasehold.Stamp, effects []unpackedEffect) (stamps, marks bool) {
	n := len(entries)
	stampV, stamps := headerGet(m.header, leasehold.HeaderStamp)
	markV, marks := headerGet(m.header, leasehold.HeaderMark)
	if !stamps && !marks {
		return false, false
	}
	// A compact value that was read is the stamp's (the mark's) one
	// spelling: the others' differ from it only in the key (in the
	// fields a final adds).
	if stamps {
		// "1 <scope> <partition> <epoch> <acquisition> <key>[ <worker>]":
		// the key starts after the fifth space.
		at := 0
		for range 5 {
			at += strings.IndexByte(stampV[at:], ' ') + 1
		}
		head, tail := stampV[:at], stampV[at+len(st.Key):]
		size := 0
		for i := range n - 1 {
			size += len(head) + len(entries[i].Key) + len(tail)
		}
		var b strings.Builder
		b.Grow(size)
		for i := range n - 1 {
			b.WriteString(head)
			b.WriteString(entries[i].Key)
			b.WriteString(tail)
		}
		all, from := b.String(), 0
		for i := range n - 1 {
			to := from + len(head) + len(entries[i].Key) + len(tail)
			effects[i].vals[0], from = all[from:to], to
		}
		effects[n-1].vals[0] = stampV
	}
	if marks {
		// "1 <job> <attempt>[ <effects> <after>[ <floor>]]": the plain
		// mark of the job and attempt is its first three fields.
		plain := markV
		at := 0
		for range 3 {
			sp := strings.IndexByte(markV[at:], ' ')
			if sp < 0 {
				at = -1
				break
			}
			at += sp + 1
		}
		if at > 0 {
			plain = markV[:at-1]
		}
		for i := range n - 1 {
			effects[i].vals[1] = plain
		}
		effects[n-1].vals[1] = markV
	}
	return stamps, marks
}

// headerSize is the wire size of headers h.
func headerSize(h map[string][]string) int {
	n := 0
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(v) + 4 // "k: v\r\n"
		}
	}
	return n
}

// headerValues returns every value of name, matched without regard to
// case, or nil.
func headerValues(h nats.Header, name string) []string {
	var out []string
	for k, vs := range h {
		if len(k) == len(name) && strings.EqualFold(k, name) {
			out = append(out, vs...)
		}
	}
	return out
}

// deleteFold deletes name from h in every spelling.
func deleteFold(h nats.Header, name string) {
	for k := range h {
		if len(k) == len(name) && strings.EqualFold(k, name) {
			delete(h, k)
		}
	}
}
