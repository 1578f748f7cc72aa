package streamsink

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
)

// A republished or dead-lettered effect carries its own stamp, written
// from the stamp that was read, in any spelling it came in, its job mark,
// and never leasehold.HeaderPack.
func TestKeepHeaderKnowsTheCompactForms(t *testing.T) {
	for name, want := range map[string]bool{
		leasehold.HeaderPack: false, "leasehold-pack": false, leasehold.HeaderStamp: false, "LEASEHOLD-STAMP": false,
		leasehold.HeaderKey: false, "leasehold-key": false, leasehold.HeaderMark: true, "leasehold-mark": true,
		leasehold.HeaderJob: true, leasehold.HeaderOrigin: true, "traceparent": true, "Nats-Msg-Id": false, "X-Other": false,
	} {
		if got := keepHeader(name); got != want {
			t.Errorf("keepHeader(%q) = %v, want %v", name, got, want)
		}
	}
	cfg := Config{Prefix: "keep", Logger: slog.New(slog.DiscardHandler)}
	cfg.setDefaults()
	r := &Runner{cfg: cfg, rep: sink.NewReporter(sink.ReporterConfig{Name: "keep", Logger: cfg.Logger})}
	st := leasehold.Stamp{Scope: "keep", Epoch: 3, Acquisition: "a3", Key: "keep.0.4.1", Worker: "w"}
	mark := leasehold.JobMark{Job: 4, Attempt: 1}
	h := nats.Header{"leasehold-stamp": {st.Compact()}, leasehold.HeaderMark: {mark.Compact()}, "leasehold-Pack": {"1 2"}}
	out := r.republished(context.Background(), &logMsg{seq: 1, subject: "keep.out.0", header: h}, st)
	got, err := leasehold.StampFromHeader(out.Header)
	if err != nil || got != st {
		t.Fatalf("republished stamp %+v (%v), want %+v", got, err, st)
	}
	if m, err := leasehold.JobMarkFromHeader(out.Header); err != nil || m != mark {
		t.Fatalf("republished mark %+v (%v), want %+v", m, err, mark)
	}
	for k := range out.Header {
		if strings.EqualFold(k, leasehold.HeaderPack) || (k != leasehold.HeaderStamp && strings.EqualFold(k, leasehold.HeaderStamp)) {
			t.Errorf("republished with header %s: %v", k, out.Header)
		}
	}
}
