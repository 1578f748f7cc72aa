package pgsink_test

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/pgsink"
)

// BenchmarkFencedVsPlain compares a fenced write (fence, dedupe and effect
// in one statement) with a plain upsert of the same row into a table of
// the same shape, on the same server. The two alternate, one of each per
// iteration, so that the machine's noise falls on both alike; it reports
// the median latency of each and their ratio.
func BenchmarkFencedVsPlain(b *testing.B) {
	_, db := startDB(b)
	ctx := context.Background()
	s := newSink(b, db, pgsink.Config{Prefix: "bench_"})
	if _, err := db.Exec(ctx, `CREATE TABLE plain (key text PRIMARY KEY, partition integer NOT NULL, epoch bigint NOT NULL,
		subject text NOT NULL, data bytea, header jsonb, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		b.Fatal(err)
	}
	if _, err := db.Exec(ctx, "ALTER TABLE bench_fence SET (fillfactor = 10)"); err != nil {
		b.Fatal(err)
	}
	const upsert = `INSERT INTO plain (key, partition, epoch, subject, data, header) VALUES ($1, $2, $3, $4, $5, $6)
		ON CONFLICT (key) DO UPDATE SET data = EXCLUDED.data, epoch = EXCLUDED.epoch`
	l := lease("orders", 3, 7)
	data := make([]byte, 256)
	var plain, fenced []time.Duration
	i := 0
	for b.Loop() {
		i++
		key := fmt.Sprintf("k-%d", i)
		t0 := time.Now()
		if _, err := db.Exec(ctx, upsert, key, int32(3), int64(7), "s", data, nil); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := s.Apply(ctx, sink.Effect{Stamp: l.Stamp(key), Subject: "s", Data: data}); err != nil {
			b.Fatal(err)
		}
		plain, fenced = append(plain, t1.Sub(t0)), append(fenced, time.Since(t1))
	}
	mp, mf := median(plain), median(fenced)
	b.ReportMetric(float64(mp.Nanoseconds()), "plain-ns")
	b.ReportMetric(float64(mf.Nanoseconds()), "fenced-ns")
	b.ReportMetric(float64(mf)/float64(mp), "ratio")
}

func median(d []time.Duration) time.Duration {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return d[len(d)/2]
}
