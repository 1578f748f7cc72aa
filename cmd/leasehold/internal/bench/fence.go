package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/internal/retry"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/sink/pgsink"
)

// writer is one way of writing an effect: fenced through a sink, or the
// unfenced write of the same kind.
type writer func(ctx context.Context, e *sink.Effect) error

// perOp times n writes and returns the mean time of one, in microseconds.
// The effects are built before the clock starts: formatting keys would
// otherwise weigh more than a memory write.
func perOp(ctx context.Context, w writer, from, n int) (float64, error) {
	data := make([]byte, pipePayload)
	effects := make([]sink.Effect, n)
	for i := range effects {
		effects[i] = effect(from+i, data)
	}
	t0 := time.Now()
	for i := range effects {
		if err := w(ctx, &effects[i]); err != nil {
			return 0, err
		}
	}
	return float64(time.Since(t0).Nanoseconds()) / float64(n) / 1e3, nil
}

// batched turns a batch write into a writer: it collects size effects and
// writes them together, so perOp's mean is the cost per effect.
func batched(size int, write func(ctx context.Context, es []sink.Effect) error) writer {
	var pending []sink.Effect
	return func(ctx context.Context, e *sink.Effect) error {
		pending = append(pending, *e)
		if len(pending) < size {
			return nil
		}
		err := write(ctx, pending)
		pending = pending[:0]
		return err
	}
}

// pairedWrites runs fenced and plain writes alternately, n of each per
// run, the order alternating, and returns the per-run microseconds.
func (e *env) pairedWrites(ctx context.Context, what string, fenced, plain writer, n int) (f, p []float64, err error) {
	// A few writes of each first, so that connections, prepared statements
	// and caches are warm for both.
	if _, err := perOp(ctx, fenced, -100, 100); err != nil {
		return nil, nil, err
	}
	if _, err := perOp(ctx, plain, -100, 100); err != nil {
		return nil, nil, err
	}
	for run := range e.cfg.Runs {
		from := run * n
		var a, b float64
		if run%2 == 0 {
			if b, err = perOp(ctx, plain, from, n); err == nil {
				a, err = perOp(ctx, fenced, from, n)
			}
		} else {
			if a, err = perOp(ctx, fenced, from, n); err == nil {
				b, err = perOp(ctx, plain, from, n)
			}
		}
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", what, err)
		}
		f, p = append(f, a), append(p, b)
	}
	e.progress("fence %s: fenced %.2f µs, plain %.2f µs (median of %d runs of %d writes)", what, median(f), median(p), len(f), n)
	return f, p, nil
}

func effect(i int, data []byte) sink.Effect {
	return sink.Effect{
		Stamp:   leasehold.Stamp{Scope: "bench", Partition: leasehold.Partition(i & 15), Epoch: 7, Acquisition: "a7", Key: fmt.Sprintf("k-%d", i+1000)},
		Subject: fmt.Sprintf("s-%d", i+1000),
		Data:    data,
	}
}

// fenceCost measures the fence's cost per effect in each sink beside an
// unfenced write of the same kind.
func (e *env) fenceCost(ctx context.Context) ([]Row, error) {
	n := map[string]int{"memory": 50000, "kv": 3000, "postgres": 3000}
	if e.cfg.Quick {
		n = map[string]int{"memory": 5000, "kv": 300, "postgres": 300}
	}
	var rows []Row

	// Memory: the reference sink (fence, dedupe and write under one
	// mutex) beside a map write under a mutex.
	mem := sink.NewMemory(sink.MemoryConfig{Logger: e.quiet()})
	var mu sync.Mutex
	plain := map[string]sink.Effect{}
	f, p, err := e.pairedWrites(ctx, "memory",
		func(ctx context.Context, eff *sink.Effect) error { return mem.Apply(ctx, *eff) },
		func(_ context.Context, eff *sink.Effect) error {
			mu.Lock()
			plain[eff.Subject] = *eff
			mu.Unlock()
			return nil
		}, n["memory"])
	if err != nil {
		return rows, err
	}
	rows = append(rows, paired("fence_memory", "µs/effect", f, p, "sink.Memory Apply (fence, dedupe, write in one critical section) vs a map write under a mutex"))

	// KV: one atomic batch (fence, dedupe key, value) vs a plain Put.
	nc, js, err := e.connect("bench fence kv")
	if err != nil {
		return rows, err
	}
	defer e.release(nc)
	defer e.dropStreams(ctx, js, "fence-")
	ks, err := kvsink.New(ctx, js, kvsink.Config{Bucket: "fence-kv", Replicas: e.replicas(), Logger: e.quiet()})
	if err != nil {
		return rows, err
	}
	kv, err := retry.Value(ctx, func(ctx context.Context) (jetstream.KeyValue, error) {
		return js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "fence-plain", History: 1, Storage: jetstream.FileStorage, Replicas: e.replicas()})
	})
	if err != nil {
		return rows, err
	}
	f, p, err = e.pairedWrites(ctx, "kv",
		func(ctx context.Context, eff *sink.Effect) error { return ks.Apply(ctx, *eff) },
		func(ctx context.Context, eff *sink.Effect) error {
			_, err := kv.Put(ctx, eff.Subject, eff.Data)
			return err
		}, n["kv"])
	if err != nil {
		return rows, err
	}
	rows = append(rows, paired("fence_kv", "µs/effect", f, p, "kvsink Apply (one atomic batch: fence, dedupe key, value) vs a KV Put of the value"))

	// KV, batched: the way the sink runner applies a fetched batch, 100
	// effects in one atomic batch, beside 100 asynchronous Puts awaited
	// together. The effects get keys of their own: the ones above were
	// applied, and the sink would take these as repeats.
	const batch = 100
	fb, pb, err := e.pairedWrites(ctx, "kv batched",
		batched(batch, func(ctx context.Context, es []sink.Effect) error {
			for i := range es {
				es[i].Stamp.Key = "batched-" + es[i].Stamp.Key
			}
			return ks.Apply(ctx, es...)
		}),
		batched(batch, func(ctx context.Context, es []sink.Effect) error {
			for i := range es {
				if _, err := js.PublishAsync("$KV.fence-plain."+es[i].Subject, es[i].Data); err != nil {
					return err
				}
			}
			select {
			case <-js.PublishAsyncComplete():
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}), n["kv"])
	if err != nil {
		return rows, err
	}
	rows = append(rows, paired("fence_kv_batch", "µs/effect", fb, pb, fmt.Sprintf("kvsink Apply of %d effects in one atomic batch (as the sink runner applies a fetched batch) vs %d asynchronous KV Puts awaited together; target ratio <= 2", batch, batch)))

	// The same, beside the writers that do part of the sink's work: an
	// unfenced idempotent writer that records each key and writes its
	// value in one atomic batch (what exactly-once takes without a fence),
	// and the atomic batch of the values alone (the floor of any write of
	// many keys in one step on this server).
	_, err = retry.Value(ctx, func(ctx context.Context) (jetstream.KeyValue, error) {
		return js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "fence-atomic", History: 1, Storage: jetstream.FileStorage, Replicas: e.replicas()})
	})
	if err != nil {
		return rows, err
	}
	if err := allowAtomic(ctx, js, "KV_fence-atomic"); err != nil {
		return rows, err
	}
	nc2 := js.Conn()
	fi, pi, err := e.pairedWrites(ctx, "kv batched vs idempotent",
		batched(batch, func(ctx context.Context, es []sink.Effect) error {
			for i := range es {
				es[i].Stamp.Key = "idem-" + es[i].Stamp.Key
			}
			return ks.Apply(ctx, es...)
		}),
		batched(batch, func(ctx context.Context, es []sink.Effect) error {
			msgs := make([]*nats.Msg, 0, 2*len(es))
			for i := range es {
				d := nats.NewMsg("$KV.fence-atomic.d." + es[i].Stamp.Key)
				d.Header.Set(jetstream.ExpectedLastSubjSeqHeader, "0")
				v := nats.NewMsg("$KV.fence-atomic." + es[i].Subject)
				v.Data = es[i].Data
				msgs = append(msgs, d, v)
			}
			return atomicPublish(ctx, nc2, msgs)
		}), n["kv"])
	if err != nil {
		return rows, err
	}
	rows = append(rows, paired("fence_kv_batch_vs_idempotent", "µs/effect", fi, pi, fmt.Sprintf("kvsink Apply of %d effects vs an unfenced idempotent writer: one atomic batch of each effect's dedupe key (created only if absent) and value; the ratio is what the fence itself adds", batch)))

	fa, pa, err := e.pairedWrites(ctx, "kv atomic floor",
		batched(batch, func(ctx context.Context, es []sink.Effect) error {
			msgs := make([]*nats.Msg, 0, len(es))
			for i := range es {
				v := nats.NewMsg("$KV.fence-atomic." + es[i].Subject)
				v.Data = es[i].Data
				msgs = append(msgs, v)
			}
			return atomicPublish(ctx, nc2, msgs)
		}),
		batched(batch, func(ctx context.Context, es []sink.Effect) error {
			for i := range es {
				if _, err := js.PublishAsync("$KV.fence-plain."+es[i].Subject, es[i].Data); err != nil {
					return err
				}
			}
			select {
			case <-js.PublishAsyncComplete():
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}), n["kv"])
	if err != nil {
		return rows, err
	}
	rows = append(rows, paired("kv_atomic_floor", "µs/effect", fa, pa, fmt.Sprintf("no fence: one atomic batch of %d values vs %d asynchronous KV Puts; the least a write of many keys in one step costs here", batch, batch)))

	row, err := e.fencePostgres(ctx, n["postgres"])
	if err != nil {
		return rows, err
	}
	rows = append(rows, row)

	verify, err := e.verifyCost(ctx)
	return append(rows, verify...), err
}

// verifyCost measures what verified epochs cost a sink per new epoch:
// sink.EpochCheck.Check of an (epoch, acquisition) it has not seen, which
// asks the lease bucket, beside one it has, which its cache answers. Both
// for a live holder's acquisition (a new holder's barrier or first write)
// and for one released since (a former holder's effect, as a sink that
// reads a log meets it).
func (e *env) verifyCost(ctx context.Context) ([]Row, error) {
	n := 200
	if e.cfg.Quick {
		n = 40
	}
	nc, js, err := e.connect("bench fence verify")
	if err != nil {
		return nil, err
	}
	defer e.release(nc)
	defer e.dropStreams(ctx, js, "fence-verify")
	bucket, err := retry.Value(ctx, func(ctx context.Context) (*coordinator.Bucket, error) {
		return coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "fence-verify", Replicas: e.replicas(), Logger: e.quiet()})
	})
	if err != nil {
		return nil, err
	}
	if _, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Stream, error) {
		return js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
			Name: bucket.Scope() + "-jobs", Subjects: []string{bucket.Scope() + ".jobs.>"}, Replicas: e.replicas(),
			Metadata: map[string]string{"leasehold.partitions": strconv.Itoa(n)},
		})
	}); err != nil {
		return nil, err
	}
	coord, err := coordinator.New(bucket, coordinator.Config{Worker: "bench", TTL: time.Minute, Partitions: n, Logger: e.quiet()})
	if err != nil {
		return nil, err
	}
	// timed is the mean time of one Check of each stamp, in microseconds.
	timed := func(c *sink.EpochCheck, stamps []leasehold.Stamp) (float64, error) {
		t0 := time.Now()
		for _, s := range stamps {
			if err := c.Check(ctx, s); err != nil {
				return 0, err
			}
		}
		return float64(time.Since(t0).Nanoseconds()) / float64(len(stamps)) / 1e3, nil
	}
	var liveNew, liveCached, formerNew, formerCached []float64
	for range e.cfg.Runs {
		stamps := make([]leasehold.Stamp, n)
		leases := make([]*coordinator.Lease, n)
		for p := range n {
			l, err := coord.Acquire(ctx, leasehold.Partition(p), coordinator.ManualRenew())
			if err != nil {
				return nil, fmt.Errorf("fence verify: acquire partition %d: %w", p, err)
			}
			leases[p], stamps[p] = l, l.Info().Stamp("k")
		}
		check := sink.NewEpochCheck(bucket)
		a, err := timed(check, stamps)
		if err != nil {
			return nil, fmt.Errorf("fence verify: %w", err)
		}
		b, err := timed(check, stamps)
		if err != nil {
			return nil, fmt.Errorf("fence verify: %w", err)
		}
		liveNew, liveCached = append(liveNew, a), append(liveCached, b)
		for _, l := range leases {
			if err := l.Release(ctx); err != nil {
				return nil, fmt.Errorf("fence verify: release: %w", err)
			}
		}
		check = sink.NewEpochCheck(bucket)
		if a, err = timed(check, stamps); err != nil {
			return nil, fmt.Errorf("fence verify: %w", err)
		}
		if b, err = timed(check, stamps); err != nil {
			return nil, fmt.Errorf("fence verify: %w", err)
		}
		formerNew, formerCached = append(formerNew, a), append(formerCached, b)
	}
	e.progress("fence verify: new epoch %.1f µs (released %.1f µs), cached %.2f µs (median of %d runs of %d checks)",
		median(liveNew), median(formerNew), median(liveCached), len(liveNew), n)
	return []Row{
		paired("fence_verify_new_epoch", "µs/check", liveNew, liveCached, fmt.Sprintf("sink.EpochCheck.Check of a live holder's epoch and acquisition the sink has not seen (the lease bucket is asked) vs one it has (cached); %d partitions", n)),
		paired("fence_verify_former_epoch", "µs/check", formerNew, formerCached, fmt.Sprintf("the same for a released holder's epoch and acquisition, as a sink that reads a log meets a former holder's effects; %d partitions", n)),
	}, nil
}

// allowAtomic lets a bucket's stream take atomic batches.
func allowAtomic(ctx context.Context, js jetstream.JetStream, stream string) error {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return err
	}
	cfg := st.CachedInfo().Config
	cfg.AllowAtomicPublish = true
	_, err = js.UpdateStream(ctx, cfg)
	return err
}

// atomicPublish publishes msgs as one JetStream atomic batch and waits for
// the commit's answer.
func atomicPublish(ctx context.Context, nc *nats.Conn, msgs []*nats.Msg) error {
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err := jspub.Batch(rctx, nc, msgs)
	return err
}

// fencePostgres measures pgsink beside a plain upsert into a table of the
// same shape, on a database from Config.Postgres or a throwaway server.
func (e *env) fencePostgres(ctx context.Context, n int) (Row, error) {
	skip := func(why string) (Row, error) {
		e.progress("fence postgres skipped: %s", why)
		return Row{Name: "fence_postgres", Unit: "µs/effect", Note: "skipped: " + why}, nil
	}
	dsn := e.cfg.Postgres
	if dsn == "" {
		if e.cfg.Quick {
			return skip("not measured with --quick")
		}
		pg, err := startPostgres(ctx, e.dir)
		if errors.Is(err, errNoPostgres) {
			return skip(err.Error())
		}
		if err != nil {
			return Row{}, err
		}
		defer pg.stop()
		dsn = pg.dsn()
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return Row{}, fmt.Errorf("postgres: %w", err)
	}
	defer pool.Close()
	cfg := pgsink.Config{DB: pool, Prefix: "bench_fence_", Logger: e.quiet()}
	if err := pgsink.CreateSchema(ctx, pool, cfg); err != nil {
		return Row{}, err
	}
	ps, err := pgsink.New(cfg)
	if err != nil {
		return Row{}, err
	}
	const table = `CREATE TABLE IF NOT EXISTS bench_plain (key text PRIMARY KEY, partition integer NOT NULL, epoch bigint NOT NULL,
		subject text NOT NULL, data bytea, header jsonb, applied_at timestamptz NOT NULL DEFAULT now())`
	if _, err := pool.Exec(ctx, table); err != nil {
		return Row{}, err
	}
	defer pool.Exec(context.WithoutCancel(ctx), "DROP TABLE IF EXISTS bench_plain, bench_fence_fence, bench_fence_effects, bench_fence_keys")
	const upsert = `INSERT INTO bench_plain (key, partition, epoch, subject, data, header) VALUES ($1, $2, $3, $4, $5, $6)
		ON CONFLICT (key) DO UPDATE SET data = EXCLUDED.data, epoch = EXCLUDED.epoch`
	f, p, err := e.pairedWrites(ctx, "postgres",
		func(ctx context.Context, eff *sink.Effect) error { return ps.Apply(ctx, *eff) },
		func(ctx context.Context, eff *sink.Effect) error {
			_, err := pool.Exec(ctx, upsert, eff.Stamp.Key, int32(eff.Stamp.Partition), int64(eff.Stamp.Epoch), eff.Subject, eff.Data, nil)
			return err
		}, n)
	if err != nil {
		return Row{}, err
	}
	return paired("fence_postgres", "µs/effect", f, p, "pgsink Apply (fence, dedupe and effect in one statement) vs a plain upsert of the same row; fsync off"), nil
}
