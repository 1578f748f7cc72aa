package worker

import (
	"slices"
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
			e.setWire(st, m, "0123456789abcdef")
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
