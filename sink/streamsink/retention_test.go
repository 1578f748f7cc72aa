package streamsink_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// A runner started before `leasehold init` does not create the effect log
// (init would then refuse it): it fails and says to run init. With
// Provision it creates a log that nothing trims and nobody can delete
// from.
func TestEffectLogProvision(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	_, err := streamsink.New(ctx, js, streamsink.Config{Prefix: "early", Logger: quiet()})
	if !errors.Is(err, streamsink.ErrNoLog) || !strings.Contains(err.Error(), "leasehold init") {
		t.Fatalf("New before init: %v, want ErrNoLog saying to run leasehold init", err)
	}
	if _, err := js.Stream(ctx, "early-effects"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("the runner created the effect log without Provision: %v", err)
	}
	r, err := streamsink.New(ctx, js, streamsink.Config{Prefix: "early", Provision: true, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, "early-effects")
	if err != nil {
		t.Fatal(err)
	}
	c := s.CachedInfo().Config
	if !c.DenyDelete || !c.DenyPurge || c.Storage != jetstream.FileStorage {
		t.Fatalf("provisioned log: deny delete %v, deny purge %v, storage %v; want both denied, file storage", c.DenyDelete, c.DenyPurge, c.Storage)
	}
	if ret := r.Retention(); ret.Trims() || ret.Deletable || !strings.Contains(ret.String(), "any time") {
		t.Fatalf("retention of the provisioned log: %+v (%s)", ret, ret)
	}
	if _, err := js.Stream(ctx, "early-sink-dlq"); err != nil {
		t.Fatalf("the dead-letter stream: %v", err)
	}
}

// A log whose limits can remove messages the runner has not handled is
// refused unless AllowTrimming accepts it; the runner then states the
// bound.
func TestTrimmingLogRefused(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	ctx := ctxFor(t, time.Minute)
	js := srv.JetStream(t)
	for _, c := range []struct {
		name  string
		cfg   jetstream.StreamConfig
		bound string
	}{
		{"age", jetstream.StreamConfig{MaxAge: 72 * time.Hour}, "within 72h0m0s"},
		{"count", jetstream.StreamConfig{MaxMsgs: 1000, Discard: jetstream.DiscardOld}, "fewer than 1000 messages"},
		{"bytes", jetstream.StreamConfig{MaxBytes: 1 << 20, Discard: jetstream.DiscardOld}, "fewer than 1048576 bytes"},
		{"subject", jetstream.StreamConfig{MaxMsgsPerSubject: 5}, "of any subject"},
		{"ttl", jetstream.StreamConfig{AllowMsgTTL: true}, "time to live"},
	} {
		t.Run(c.name, func(t *testing.T) {
			prefix := "trim" + c.name
			sc := c.cfg
			sc.Name, sc.Subjects = prefix+"-effects", []string{prefix + ".out.>"}
			if _, err := js.CreateStream(ctx, sc); err != nil {
				t.Fatal(err)
			}
			cfg := streamsink.Config{Prefix: prefix, Logger: quiet()}
			_, err := streamsink.New(ctx, js, cfg)
			if !errors.Is(err, streamsink.ErrTrimmedLog) || !strings.Contains(err.Error(), c.bound) {
				t.Fatalf("New: %v, want ErrTrimmedLog naming %q", err, c.bound)
			}
			cfg.AllowTrimming = true
			r, err := streamsink.New(ctx, js, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if ret := r.Retention(); !ret.Trims() || !ret.Deletable || !strings.Contains(ret.String(), c.bound) {
				t.Fatalf("Retention: %+v (%s), want it to trim, be deletable and say %q", ret, ret, c.bound)
			}
		})
	}
	// A count limit that refuses new messages removes nothing.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "full-effects", Subjects: []string{"full.out.>"}, MaxMsgs: 10, Discard: jetstream.DiscardNew, DenyDelete: true, DenyPurge: true}); err != nil {
		t.Fatal(err)
	}
	r, err := streamsink.New(ctx, js, streamsink.Config{Prefix: "full", Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if ret := r.Retention(); ret.Trims() || ret.Deletable {
		t.Fatalf("a log that refuses new messages when full: %+v", ret)
	}
}
