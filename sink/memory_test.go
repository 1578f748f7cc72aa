package sink_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/testleak"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/sinktest"
)

func TestMain(m *testing.M) { testleak.VerifyTestMain(m) }

func TestMemoryConformance(t *testing.T) {
	sinktest.Run(t, sinktest.Features{AtomicBatch: true, Dedupe: true, VerifiedEpochs: true}, func(t *testing.T, s sinktest.Setup) sinktest.Instance {
		m := sink.NewMemory(sink.MemoryConfig{KeepLog: true, Observer: s.Observer, Verifier: s.Verifier, Logger: quiet()})
		return sinktest.Instance{
			Sink:    m,
			Applied: func(context.Context) ([]sink.Effect, error) { return m.Applied(), nil },
		}
	})
}

// Drops are logged at most once per fence per interval, with the
// number held back.
func TestDropLogIsRateLimited(t *testing.T) {
	var buf bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&buf, nil))
	m := sink.NewMemory(sink.MemoryConfig{Logger: logger})
	ctx := context.Background()
	for _, p := range []leasehold.Partition{1, 2} {
		if err := m.Advance(ctx, leasehold.Lease{Scope: "orders", Partition: p, Epoch: 10, Acquisition: "a10", Holder: "w"}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 50 {
		for _, p := range []leasehold.Partition{1, 2} {
			e := sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Partition: p, Epoch: 3, Acquisition: "a3", Key: "k" + string(rune('a'+i%26))}}
			if err := m.Apply(ctx, e); err == nil {
				t.Fatal("a stale effect was accepted")
			}
		}
	}
	d := func(p leasehold.Partition) uint64 { return m.Dropped(leasehold.FenceID{Scope: "orders", Partition: p}) }
	if d(1) != 50 || d(2) != 50 || d(3) != 0 {
		t.Fatalf("dropped %d, %d, %d; want 50, 50, 0", d(1), d(2), d(3))
	}
	// The test runs well within the one-second interval, so each partition
	// logs its first drop only.
	if n := strings.Count(buf.String(), "effect dropped"); n != 2 {
		t.Fatalf("%d drop lines, want 2 (one per partition):\n%s", n, buf.String())
	}
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// BenchmarkMemoryAdmit measures the fence check and write of one admitted
// effect: the path every effect takes.
func BenchmarkMemoryAdmit(b *testing.B) {
	m := sink.NewMemory(sink.MemoryConfig{NoDedupe: true, Logger: quiet()})
	ctx := context.Background()
	e := sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Partition: 3, Epoch: 7, Acquisition: "a7", Key: "k"}, Subject: "s", Data: []byte("v")}
	b.ReportAllocs()
	for b.Loop() {
		if err := m.Apply(ctx, e); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMemoryReject measures a refused stale effect, drop counting
// included.
func BenchmarkMemoryReject(b *testing.B) {
	m := sink.NewMemory(sink.MemoryConfig{NoDedupe: true, Logger: quiet()})
	ctx := context.Background()
	_ = m.Advance(ctx, leasehold.Lease{Scope: "orders", Partition: 3, Epoch: 9, Acquisition: "a9", Holder: "w"})
	e := sink.Effect{Stamp: leasehold.Stamp{Scope: "orders", Partition: 3, Epoch: 7, Acquisition: "a7", Key: "k"}, Subject: "s"}
	b.ReportAllocs()
	for b.Loop() {
		if err := m.Apply(ctx, e); err == nil {
			b.Fatal("accepted")
		}
	}
}
