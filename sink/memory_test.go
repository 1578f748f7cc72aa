package sink_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/testing/sinktest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestMemoryConformance(t *testing.T) {
	sinktest.Run(t, sinktest.Features{AtomicBatch: true, Dedupe: true, VerifiedEpochs: true}, func(t *testing.T, s sinktest.Setup) sinktest.Instance {
		m := sink.NewMemory(sink.MemoryConfig{KeepLog: true, Observer: s.Observer, Verifier: s.Verifier, Logger: quiet()})
		return sinktest.Instance{
			Sink:    m,
			Applied: func(context.Context) ([]sink.Effect, error) { return m.Applied(), nil },
		}
	})
}

// Drops are logged at most once per partition per interval, with the
// number held back.
func TestDropLogIsRateLimited(t *testing.T) {
	var buf bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&buf, nil))
	m := sink.NewMemory(sink.MemoryConfig{Logger: logger})
	ctx := context.Background()
	if err := m.Advance(ctx, 1, 10); err != nil {
		t.Fatal(err)
	}
	if err := m.Advance(ctx, 2, 10); err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		for _, p := range []leasehold.Partition{1, 2} {
			e := sink.Effect{Stamp: leasehold.Stamp{Partition: p, Epoch: 3, Key: "k" + string(rune('a'+i%26))}}
			if err := m.Apply(ctx, e); err == nil {
				t.Fatal("a stale effect was accepted")
			}
		}
	}
	if m.Dropped(1) != 50 || m.Dropped(2) != 50 || m.Dropped(3) != 0 {
		t.Fatalf("dropped %d, %d, %d; want 50, 50, 0", m.Dropped(1), m.Dropped(2), m.Dropped(3))
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
	e := sink.Effect{Stamp: leasehold.Stamp{Partition: 3, Epoch: 7, Key: "k"}, Subject: "s", Data: []byte("v")}
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
	_ = m.Advance(ctx, 3, 9)
	e := sink.Effect{Stamp: leasehold.Stamp{Partition: 3, Epoch: 7, Key: "k"}, Subject: "s"}
	b.ReportAllocs()
	for b.Loop() {
		if err := m.Apply(ctx, e); err == nil {
			b.Fatal("accepted")
		}
	}
}
