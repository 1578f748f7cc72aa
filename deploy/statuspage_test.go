package deploy

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

// The status page as the worker and sink users run it, on a server with
// the users of nats/nats-server.conf: each publishes its own events (the
// worker its lease events, the sink its refusals) and serves the page from
// the lease bucket, the events stream and the dead-letter streams, with no
// permissions violation and nothing the page could not read. Neither can
// publish the other's events: a sink cannot forge a take-over, nor a worker
// a refusal.
func TestPermissionsStatusPage(t *testing.T) {
	setPasswords(t)
	parsed, err := server.ProcessConfigFile(filepath.FromSlash("nats/nats-server.conf"))
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.Start(t, natstest.Listen(), natstest.Tweak(func(o *server.Options) {
		o.Accounts, o.Users = parsed.Accounts, parsed.Users
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin := connectAs(t, srv, "admin")
	if _, err := coordinator.Provision(ctx, admin.js, coordinator.BucketConfig{}); err != nil {
		t.Fatal(err)
	}
	if err := worker.ProvisionJobs(ctx, admin.js, worker.JobsConfig{Prefix: "leasehold", Partitions: 2, Replicas: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := statuspage.ProvisionEvents(ctx, admin.js, "leasehold", 1); err != nil {
		t.Fatalf("admin: the events stream: %v", err)
	}
	// A partition held, so that the page has a row and a lag to read.
	ab, err := coordinator.OpenBucket(ctx, admin.js, "")
	if err != nil {
		t.Fatal(err)
	}
	co, err := coordinator.New(ab, coordinator.Config{Worker: "w1", Partitions: 2, TTL: 5 * time.Second, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	held, err := co.Acquire(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release(context.Background())
	lease := held.Info()

	for _, c := range []struct {
		user    string
		publish func(*statuspage.Publisher)
		page    func(*coordinator.Bucket) statuspage.Config
		shows   func(statuspage.State) bool
	}{
		{
			user: "worker",
			publish: func(p *statuspage.Publisher) {
				o := p.WorkerObserver(nil)
				o.WorkerEvent(ctx, worker.Event{Kind: worker.EventPartitionAcquired, Lease: lease, Time: time.Now()})
				o.WorkerEvent(ctx, worker.Event{Kind: worker.EventPartitionLost, Lease: lease, Err: leasehold.ErrLeaseLost, Time: time.Now()})
			},
			page: func(b *coordinator.Bucket) statuspage.Config {
				return statuspage.Config{Bucket: b, Prefix: "leasehold", Lag: true, DeadLetters: statuspage.DefaultDeadLetters("leasehold", true, false)}
			},
			shows: func(st statuspage.State) bool { return len(st.Losses) == 1 },
		},
		{
			user: "sink",
			publish: func(p *statuspage.Publisher) {
				p.SinkObserver().Decided(ctx, sink.Decision{Outcome: sink.Stale, Stamp: lease.Stamp("k"), Max: 9})
			},
			page: func(b *coordinator.Bucket) statuspage.Config {
				return statuspage.Config{Bucket: b, Prefix: "leasehold", DeadLetters: statuspage.DefaultDeadLetters("leasehold", false, true)}
			},
			shows: func(st statuspage.State) bool { return len(st.Refusals) >= 1 },
		},
	} {
		t.Run(c.user, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			u := connectAs(t, srv, c.user)
			p := statuspage.NewPublisher(statuspage.PublisherConfig{JetStream: u.js, Prefix: "leasehold", Source: c.user})
			c.publish(p)
			p.Close()
			if p.Dropped() != 0 {
				t.Errorf("%s: %d events dropped (violations: %v)", c.user, p.Dropped(), u.violations())
			}
			b, err := coordinator.OpenBucket(ctx, u.js, "")
			if err != nil {
				t.Fatal(err)
			}
			cfg := c.page(b)
			cfg.JetStream, cfg.Refresh = u.js, 100*time.Millisecond
			page := statuspage.New(cfg)
			pctx, stop := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); page.Run(pctx) }()
			defer func() { stop(); <-done }()
			mux := http.NewServeMux()
			page.Register(mux)
			hs := httptest.NewServer(mux)
			defer hs.Close()
			for {
				// As a browser asks: the page reads only while watched.
				st, err := getState(ctx, hs.URL+"/status.json")
				if err != nil {
					t.Fatal(err)
				}
				if len(st.Errors) == 0 && len(st.Partitions) == 1 && st.Partitions[0].Holder == "w1" && len(st.DeadLetters) == 2 && c.shows(st) {
					bad := false
					for _, d := range st.DeadLetters {
						bad = bad || d.Error != "" && d.Error != "no such stream (yet)"
					}
					if !bad {
						break
					}
				}
				select {
				case <-ctx.Done():
					t.Fatalf("%s: the page never read everything: errors %v, %d partitions, dead letters %+v (violations: %v)", c.user, st.Errors, len(st.Partitions), st.DeadLetters, u.violations())
				case <-time.After(50 * time.Millisecond):
				}
			}
			u.noViolations(t)
		})
	}
	for _, c := range []struct{ user, subject, why string }{
		{"sink", statuspage.EventSubject("leasehold", statuspage.KindAcquired), "a sink must not forge take-overs"},
		{"worker", statuspage.EventSubject("leasehold", statuspage.KindRefused), "a worker must not forge refusals"},
	} {
		t.Run("deny/"+c.user, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			u := connectAs(t, srv, c.user)
			if err := u.nc.Publish(c.subject, []byte("{}")); err != nil {
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
}

func getState(ctx context.Context, url string) (statuspage.State, error) {
	var st statuspage.State
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return st, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	return st, json.NewDecoder(resp.Body).Decode(&st)
}
