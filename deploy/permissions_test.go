package deploy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// TestPermissions starts a server with the users of nats/nats-server.conf
// (the same as the Helm values, see TestHelmUsersMatchComposeConfig) and
// runs leasehold's own code as each of them: the admin provisions, the
// producer enqueues, a real worker takes leases, handles jobs, publishes
// effects, commits and hands off, and the sink reads the lease bucket,
// consumes the effects and writes its KV bucket. None of them may meet a
// permissions violation. Then each tries what its user must not do.
func TestPermissions(t *testing.T) {
	setPasswords(t)
	parsed, err := server.ProcessConfigFile(filepath.FromSlash("nats/nats-server.conf"))
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.Start(t, natstest.Listen(), natstest.SyncAlways(), natstest.Tweak(func(o *server.Options) {
		o.Accounts, o.Users = parsed.Accounts, parsed.Users
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const partitions, jobs = 2, 20

	// `leasehold init`, as admin.
	admin := connectAs(t, srv, "admin")
	if _, err := coordinator.Provision(ctx, admin.js, coordinator.BucketConfig{}); err != nil {
		t.Fatalf("admin: provision the lease bucket: %v", err)
	}
	if err := worker.ProvisionJobs(ctx, admin.js, worker.JobsConfig{Prefix: "leasehold", Partitions: partitions, Replicas: 1}); err != nil {
		t.Fatalf("admin: provision the streams: %v", err)
	}

	producer := connectAs(t, srv, "producer")
	p, err := worker.NewProducer(producer.js, worker.ProducerConfig{Prefix: "leasehold", Partitions: partitions})
	if err != nil {
		t.Fatal(err)
	}
	for i := range jobs {
		if _, err := p.Enqueue(ctx, []byte(fmt.Sprint("key-", i)), []byte(fmt.Sprint("job-", i))); err != nil {
			t.Fatalf("producer: enqueue: %v", err)
		}
	}
	producer.noViolations(t)

	// A real worker, as the worker user, until every job is handled.
	wu := connectAs(t, srv, "worker")
	bucket, err := coordinator.OpenBucket(ctx, wu.js, "")
	if err != nil {
		t.Fatalf("worker: open the lease bucket: %v", err)
	}
	finished := make(chan struct{}, jobs*4)
	w, err := worker.New(worker.Config{
		JetStream:   wu.js,
		Prefix:      "leasehold",
		Partitions:  partitions,
		Bucket:      bucket,
		Coordinator: coordinator.Config{Worker: "permissions-test"},
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			return j.Emit(ctx, j.Data)
		}),
		Observer: worker.ObserverFunc(func(_ context.Context, e worker.Event) {
			if e.Kind == worker.EventJobFinished {
				finished <- struct{}{}
			}
		}),
		Logger: quietLogger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- w.Run(ctx) }()
	for range jobs {
		select {
		case <-finished:
		case err := <-wu.errs:
			if errors.Is(err, nats.ErrPermissionViolation) {
				t.Fatalf("worker: leasehold's own work was refused: %v; widen the worker user's permissions in nats/nats-server.conf and helm/nats-values.yaml", err)
			}
		case err := <-runErr:
			t.Fatalf("worker: Run returned early: %v (violations: %v)", err, wu.violations())
		case <-ctx.Done():
			t.Fatalf("worker: jobs not handled: %v (violations: %v)", ctx.Err(), wu.violations())
		}
	}
	if err := w.Stop(ctx); err != nil {
		t.Fatalf("worker: stop: %v", err)
	}
	if err := <-runErr; err != nil {
		t.Fatalf("worker: Run: %v", err)
	}
	wu.noViolations(t)

	// The sink: verify epochs from the lease bucket, consume effects, write
	// its own bucket.
	su := connectAs(t, srv, "sink")
	sb, err := coordinator.OpenBucket(ctx, su.js, "")
	if err != nil {
		t.Fatalf("sink: open the lease bucket: %v", err)
	}
	for part := range partitions {
		if e, err := sb.FencedEpoch(ctx, leasehold.Partition(part)); err != nil || e == 0 {
			t.Fatalf("sink: fenced epoch of partition %d: %d, %v", part, e, err)
		}
	}
	// The stream sink runner in front of the KV sink, as `leasehold sink
	// --kind kv` runs them: its consumer, state bucket, dead-letter stream
	// and the KV bucket, all created by the sink user on first start.
	ks, err := kvsink.New(ctx, su.js, kvsink.Config{Bucket: "leasehold-sink", Logger: quietLogger()})
	if err != nil {
		t.Fatalf("sink: the KV sink: %v (violations: %v)", err, su.violations())
	}
	accepted := make(chan struct{}, jobs*4)
	r, err := streamsink.New(ctx, su.js, streamsink.Config{
		Prefix: "leasehold", Consumer: "leasehold-sink", Name: "sink", Verifier: sb, Logger: quietLogger(),
		BatchHandler: func(ctx context.Context, effects []sink.Effect) error {
			for i := range effects {
				effects[i].Subject = effects[i].Stamp.Key
			}
			return ks.Apply(ctx, effects...)
		},
		Observer: sink.ObserverFunc(func(_ context.Context, d sink.Decision) {
			if d.Outcome == sink.Accepted {
				accepted <- struct{}{}
			}
		}),
	})
	if err != nil {
		t.Fatalf("sink: the stream sink runner: %v (violations: %v)", err, su.violations())
	}
	rctx, stop := context.WithCancel(ctx)
	sinkErr := make(chan error, 1)
	go func() { sinkErr <- r.Run(rctx) }()
	for range jobs {
		select {
		case <-accepted:
		case err := <-su.errs:
			if errors.Is(err, nats.ErrPermissionViolation) {
				t.Fatalf("sink: leasehold's own work was refused: %v; widen the sink user's permissions in nats/nats-server.conf and helm/nats-values.yaml", err)
			}
		case err := <-sinkErr:
			t.Fatalf("sink: Run returned early: %v (violations: %v)", err, su.violations())
		case <-ctx.Done():
			t.Fatalf("sink: effects not applied: %v (violations: %v)", ctx.Err(), su.violations())
		}
	}
	if err := r.Ready(ctx); err != nil {
		t.Errorf("sink: not ready after applying every effect: %v", err)
	}
	stop()
	<-sinkErr
	kv, err := su.js.KeyValue(ctx, "leasehold-sink")
	if err != nil {
		t.Fatalf("sink: its bucket: %v", err)
	}
	if _, err := kv.Get(ctx, leasehold.EffectKey("leasehold", 0, 1, 0)); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("sink: read its bucket: %v", err)
	}
	su.noViolations(t)

	// What each user must not do. A lease write is the one that matters
	// most: see deploy/README.md on what permissions cannot stop.
	for _, c := range []struct{ user, subject, why string }{
		{"sink", "$KV.leasehold-leases.partition.0", "a sink must never write a lease"},
		{"sink", "leasehold.out.0", "a sink must not forge effects"},
		{"sink", "$JS.API.CONSUMER.CREATE.leasehold-jobs.x.leasehold.jobs.0", "a sink does not read jobs"},
		{"producer", "$KV.leasehold-leases.partition.0", "a producer must not write a lease"},
		{"producer", "leasehold.out.0", "a producer must not forge effects"},
		{"worker", "leasehold.jobs.0", "a worker does not enqueue jobs"},
		{"worker", "$JS.API.STREAM.DELETE.leasehold-jobs", "a worker cannot delete streams"},
		{"worker", "$JS.API.STREAM.PURGE.KV_leasehold-leases", "a worker cannot purge the lease bucket"},
		{"worker", "$JS.API.STREAM.UPDATE.KV_leasehold-leases", "a worker cannot change the lease bucket"},
		{"worker", "$JS.API.CONSUMER.CREATE.leasehold-effects.x", "a worker does not consume effects"},
		{"worker", "$KV.leasehold-sink.effect.1", "a worker cannot write the sink's bucket"},
	} {
		t.Run(c.user+"/"+c.subject, func(t *testing.T) {
			u := connectAs(t, srv, c.user)
			if err := u.nc.Publish(c.subject, []byte("x")); err != nil {
				t.Fatal(err)
			}
			if err := u.nc.FlushWithContext(ctx); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-u.errs:
				if !errors.Is(err, nats.ErrPermissionViolation) || !strings.Contains(err.Error(), c.subject) {
					t.Fatalf("%s: got %v, want a permissions violation for %s", c.why, err, c.subject)
				}
			case <-ctx.Done():
				t.Fatalf("%s: the server let %s publish to %s", c.why, c.user, c.subject)
			}
		})
	}
	// And read what they must not read.
	for _, c := range []struct{ user, subject string }{
		{"worker", "leasehold.out.>"},
		{"sink", "leasehold.jobs.>"},
	} {
		t.Run("subscribe/"+c.user+"/"+c.subject, func(t *testing.T) {
			u := connectAs(t, srv, c.user)
			sub, err := u.nc.SubscribeSync(c.subject)
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Unsubscribe()
			if err := u.nc.FlushWithContext(ctx); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-u.errs:
				if !errors.Is(err, nats.ErrPermissionViolation) {
					t.Fatalf("got %v, want a permissions violation", err)
				}
			case <-ctx.Done():
				t.Fatalf("the server let %s subscribe to %s", c.user, c.subject)
			}
		})
	}
}

// natsUserConn is a connection as one user, with its asynchronous errors.
type natsUserConn struct {
	user string
	nc   *nats.Conn
	js   jetstream.JetStream
	errs chan error

	mu  sync.Mutex
	all []error
}

func connectAs(t *testing.T, srv *natstest.Server, user string) *natsUserConn {
	t.Helper()
	u := &natsUserConn{user: user, errs: make(chan error, 64)}
	u.nc = srv.Connect(t,
		nats.UserInfo(user, "pw-"+strings.ToUpper(user)+"_PASSWORD"),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			u.mu.Lock()
			u.all = append(u.all, err)
			u.mu.Unlock()
			select {
			case u.errs <- err:
			default:
			}
		}))
	js, err := jetstream.New(u.nc)
	if err != nil {
		t.Fatal(err)
	}
	u.js = js
	return u
}

func (u *natsUserConn) violations() []error {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []error
	for _, err := range u.all {
		if errors.Is(err, nats.ErrPermissionViolation) {
			out = append(out, err)
		}
	}
	return out
}

// noViolations fails the test if the server refused anything the user's
// work needed. The server reports a refused publish asynchronously, so a
// ping round trip first makes sure every report has arrived.
func (u *natsUserConn) noViolations(t *testing.T) {
	t.Helper()
	if err := u.nc.Flush(); err != nil {
		t.Fatalf("%s: flush: %v", u.user, err)
	}
	if v := u.violations(); len(v) > 0 {
		t.Errorf("%s: leasehold's own work was refused: %v; widen the %s user's permissions in nats/nats-server.conf and helm/nats-values.yaml", u.user, v, u.user)
	}
}

// quietLogger discards the worker's logs unless LEASEHOLD_TEST_LOG is set.
func quietLogger() *slog.Logger {
	if os.Getenv("LEASEHOLD_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}
