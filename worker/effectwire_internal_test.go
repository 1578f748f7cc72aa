package worker

import (
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// setWire writes the headers SetHeaderAs (compact) and MessageID write,
// value for value, from one string; a standalone mark writes none. Each
// value's slice is the message's own: writing one leaves the others be.
func TestSetWireWritesWhatSetHeaderAsWrites(t *testing.T) {
	stamps := []leasehold.Stamp{
		{Scope: "orders", Partition: 7, Epoch: 1796632667003349, Acquisition: "a1796632667003349", Key: "orders.7.42"},
		{Scope: "s", Partition: 0, Epoch: 1, Acquisition: "x", Key: "k.0.1", Worker: "vm-adb4c8"},
	}
	marks := []leasehold.JobMark{{Job: 42, Attempt: 3}, {Job: 1<<64 - 1, Attempt: 1<<64 - 1}, {}}
	for _, st := range stamps {
		for _, m := range marks {
			want := nats.Header{"Traceparent": {"00-x"}}
			st.SetHeaderAs(want, leasehold.StampCompact)
			m.SetHeaderAs(want, leasehold.StampCompact)
			want[jetstream.MsgIDHeader] = []string{MessageID(st, "0123456789abcdef")}

			e := &effectMsg{Msg: nats.Msg{Header: nats.Header{"Traceparent": {"00-x"}}}}
			e.setWire(st, m, []byte("0123456789abcdef"))
			if len(e.Header) != len(want) {
				t.Fatalf("%+v %+v: headers %v, want %v", st, m, e.Header, want)
			}
			for k, vs := range want {
				if !slices.Equal(e.Header[k], vs) {
					t.Errorf("%+v %+v: %s is %q, want %q", st, m, k, e.Header[k], vs)
				}
			}
			e.Header[leasehold.HeaderStamp] = append(e.Header[leasehold.HeaderStamp], "more")
			if got := e.Header[jetstream.MsgIDHeader]; !slices.Equal(got, want[jetstream.MsgIDHeader]) {
				t.Errorf("appending to the stamp's values changed the message ID's: %q", got)
			}
		}
	}
}

// setFinal writes what SetHeader writes for the final's mark, in the
// widest marks too, and leaves every value before it as it was: the
// attempt's mark, read before, still reads the same (the final's bytes
// are new ones), and so do the stamp and the message ID.
func TestSetFinalWritesWhatSetHeaderWrites(t *testing.T) {
	st := leasehold.Stamp{Scope: "orders", Partition: 7, Epoch: 1796632667003349, Acquisition: "a1796632667003349", Key: "orders.7.42", Worker: "vm-adb4c8"}
	// The widest numbers a mark may carry.
	max := uint64(1 << 63)
	for _, m := range []leasehold.JobMark{{Job: 42, Attempt: 3}, {Job: max, Attempt: 1 << 32}} {
		finals := []leasehold.JobMark{
			{Job: m.Job, Attempt: m.Attempt, Effects: 1},
			{Job: m.Job, Attempt: m.Attempt, Effects: leasehold.MaxJobEffects, After: m.Job - 1},
			{Job: m.Job, Attempt: m.Attempt, Effects: leasehold.MaxJobEffects, After: m.Job - 1, Floor: m.Job - 1, Floored: true},
		}
		for _, f := range finals {
			e := &effectMsg{Msg: nats.Msg{Header: nats.Header{}}}
			e.setWire(st, m, []byte("0123456789abcdef"))
			before := cloneHeader(e.Header)
			attempt := e.Header[leasehold.HeaderMark][0]
			spare := e.spare
			// The room setWire left holds the widest final: writing it
			// allocates nothing.
			if n := testing.AllocsPerRun(10, func() { e.spare = spare; e.setFinal(f) }); n != 0 {
				t.Errorf("%+v: setFinal made %v allocations, want none", f, n)
			}

			want := cloneHeader(before)
			f.SetHeader(want)
			for k, vs := range want {
				if !slices.Equal(e.Header[k], vs) {
					t.Errorf("%+v: %s is %q, want %q", f, k, e.Header[k], vs)
				}
			}
			if len(e.Header) != len(want) {
				t.Errorf("%+v: headers %v, want %v", f, e.Header, want)
			}
			if got, err := leasehold.JobMarkFromHeader(e.Header); err != nil || got != f {
				t.Errorf("%+v: the final reads back as %+v, %v", f, got, err)
			}
			if attempt != m.Compact() {
				t.Errorf("%+v: the attempt's mark, read before the final, now reads %q, want %q", f, attempt, m.Compact())
			}
			for _, k := range []string{leasehold.HeaderStamp, jetstream.MsgIDHeader} {
				if !slices.Equal(e.Header[k], before[k]) {
					t.Errorf("%+v: %s changed from %q to %q", f, k, before[k], e.Header[k])
				}
			}
		}
	}
}

func cloneHeader(h nats.Header) nats.Header {
	c := make(nats.Header, len(h))
	for k, vs := range h {
		c[k] = slices.Clone(vs)
	}
	return c
}

// wireLines and unwrittenSize count, before anything is written, exactly
// the bytes setWire's headers then add on the wire: an effect held with
// Config.PackEffects is sized against the max payload by that count, and
// a count short of it would let through an effect no sink can store. With
// no header yet, the count takes the header's framing too.
func TestWireLinesCountWhatSetWireAdds(t *testing.T) {
	st := leasehold.Stamp{Scope: "orders", Partition: 7, Epoch: 1796632667003349, Acquisition: "a1796632667003349", Key: "orders.7.42", Worker: "vm-adb4c8"}
	long := st
	long.Key = strings.Repeat("k", 300) // past the stack buffer
	for _, s := range []leasehold.Stamp{st, long} {
		for _, m := range []leasehold.JobMark{{Job: 42, Attempt: 3}, {Job: 1<<64 - 1, Attempt: 1<<64 - 1}, {}} {
			for _, h := range []nats.Header{{}, {"Traceparent": {"00-x"}}} {
				counted := unwrittenSize(h, wireLines(s, m, []byte("0123456789abcdef")))
				before, headers := headerSize(h), len(h)
				e := &effectMsg{Msg: nats.Msg{Header: h}}
				e.setWire(s, m, []byte("0123456789abcdef"))
				if got := headerSize(e.Header) - before; got != counted {
					t.Errorf("key of %d bytes, mark %+v, %d headers before: setWire added %d bytes, the count is %d", len(s.Key), m, headers, got, counted)
				}
			}
		}
	}
	if n := unwrittenSize(nats.Header{}, 0); n != 0 {
		t.Errorf("nothing unwritten counts %d bytes", n)
	}
}
