package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/worker"
)

func newInit() *cobra.Command {
	var (
		conn            natsFlags
		partitions      int
		replicas        int
		schedules       bool
		window          time.Duration
		markerTTL       time.Duration
		monitor         string
		fenceBucket     string
		epochFloor      uint64
		restartProgress bool
	)
	cmd := &cobra.Command{
		Use:   "init",
		Short: "Provision the lease bucket and streams on a NATS server",
		Long: `init creates (or checks) everything a deployment needs, with the recommended
settings: the lease bucket (per-key TTLs, history 1, file storage, an epoch
floor) and its fence-record bucket <bucket>-fences (epochs and progress, no
TTL), the job stream <prefix>-jobs on <prefix>.jobs.<partition>, the
dead-letter stream <prefix>-dlq, the effect log <prefix>-effects (whose
messages nobody may delete or purge by hand: a sink stops at such a gap) and the
status page's events stream <prefix>-events (an hour of take-overs, lease
losses and refused writes). Running it
again is safe: existing resources are checked, and a mismatch is reported with
what to change. It also reads the servers' settings and says which ones a
production deployment lacks (sync_interval: always, replicas).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			nc, js, err := conn.connect(ctx, "leasehold init")
			if err != nil {
				return err
			}
			defer nc.Close()
			if partitions, err = conn.resolvePartitions(ctx, js, partitions, defaultPartitions); err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{
				Bucket: conn.leaseBucket(), Scope: conn.prefix, FenceBucket: fenceBucket, Replicas: replicas, MarkerTTL: markerTTL,
				EpochFloor: leasehold.Epoch(epochFloor), RestartProgress: restartProgress,
			})
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "lease bucket %s and fence records %s: ready\n", b.Name(), b.FenceBucket())
			effects := worker.EffectsStream(conn.prefix)
			_, serr := js.Stream(ctx, effects)
			fresh := errors.Is(serr, jetstream.ErrStreamNotFound)
			if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: conn.prefix, Partitions: partitions, Replicas: replicas, Schedules: schedules, Duplicates: window}); err != nil {
				return err
			}
			fmt.Fprintf(out, "streams %s, %s and %s: ready (%d partitions, %d replicas)\n",
				worker.JobsStream(conn.prefix), worker.DLQStream(conn.prefix), effects, partitions, replicas)
			note, err := guardEffectLog(ctx, js, effects, fresh)
			if err != nil {
				return err
			}
			if note != "" {
				fmt.Fprintln(out, "note:", note)
			}
			if _, err := statuspage.ProvisionEvents(ctx, js, conn.prefix, replicas); err != nil {
				return err
			}
			fmt.Fprintf(out, "stream %s: ready (the status page's take-overs and refusals, kept an hour)\n", statuspage.EventsStream(conn.prefix))
			for _, w := range serverAdvice(ctx, nc, monitor, replicas) {
				fmt.Fprintln(out, "note:", w)
			}
			return nil
		},
	}
	conn.register(cmd.Flags())
	cmd.Flags().IntVar(&partitions, "partitions", 0, "partitions of the job stream (default 64; when the job stream exists, the count it records, which cannot change)")
	cmd.Flags().DurationVar(&window, "duplicate-window", 0, "how long a repeated job ID is dropped as a duplicate, on every stream (default 2m; given, it is set on existing streams too)")
	cmd.Flags().BoolVar(&schedules, "schedules", false, "turn message schedules (delayed and periodic jobs) on for the job stream, for good; the stream then allows roll-ups, with which any publisher allowed on a job subject can purge a partition's waiting jobs, so only trusted publishers may write job subjects")
	cmd.Flags().IntVar(&replicas, "replicas", 1, "replicas of every stream and of the lease bucket (3 in production)")
	cmd.Flags().DurationVar(&markerTTL, "marker-ttl", time.Minute, "how long release and expiry markers stay in the lease bucket")
	cmd.Flags().StringVar(&fenceBucket, "fence-bucket", "", "the fence-record bucket, which keeps epochs and progress and outlives the lease bucket (default <bucket>-fences)")
	cmd.Flags().Uint64Var(&epochFloor, "epoch-floor", 0, "when the lease bucket and its fence records are both gone: start epochs above this one, the highest any sink has recorded")
	cmd.Flags().BoolVar(&restartProgress, "restart-progress", false, "when the fence records are gone: accept that every partition's progress starts at the job stream's beginning")
	cmd.Flags().StringVar(&monitor, "monitor", "", "NATS monitoring URL to read server settings from (default: the server's host, port 8222)")
	return cmd
}

// defaultPartitions is init's partition count. A partition is the unit a
// worker holds, so the count bounds a fleet: workers beyond it idle, and
// it cannot change once the stream exists. Jobs of one partition run side
// by side now (worker.Config.PartitionConcurrency), so the count is no
// longer what sets throughput; 64 lets a fleet grow to tens of workers.
// Measured with `leasehold bench --only partitions`, an idle partition
// costs the server about 37 KiB and 49 µs of CPU a second (its consumer)
// and its worker about 40 KiB and 90 µs a second: 64 of them about 2.5 MiB
// and well under 1% of a core on each side.
const defaultPartitions = 64

// guardEffectLog makes sure nobody can delete or purge messages of the
// effect log by hand: a sink stops at a message removed before it handled
// it, since it may have been a take-over's barrier, and warns at start
// about a log that allows it. A log this init created gets DenyDelete and
// DenyPurge; an existing one that lacks them is left as it is (the server
// never lets them be turned off again) and the returned note says how to
// set them.
func guardEffectLog(ctx context.Context, js jetstream.JetStream, name string, fresh bool) (note string, err error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return "", fmt.Errorf("look up the effect log %s: %w", name, err)
	}
	sc := s.CachedInfo().Config
	if sc.DenyDelete && sc.DenyPurge {
		return "", nil
	}
	if !fresh {
		return fmt.Sprintf("the effect log %s lets anyone allowed delete or purge its messages, and a sink stops at a message removed before it handled it (it may have been a take-over's barrier); forbid it with `nats stream edit %s --deny-delete --deny-purge` (for good: the server does not allow it again)", name, name), nil
	}
	sc.DenyDelete, sc.DenyPurge = true, true
	if _, err := js.UpdateStream(ctx, sc); err != nil {
		return "", fmt.Errorf("forbid deleting and purging messages of the effect log %s: %w", name, err)
	}
	return "", nil
}

// varz is the part of a server's /varz that init reads.
type varz struct {
	Name      string `json:"server_name"`
	JetStream struct {
		Config *struct {
			SyncInterval time.Duration `json:"sync_interval"`
			SyncAlways   bool          `json:"sync_always"`
		} `json:"config"`
	} `json:"jetstream"`
}

// serverAdvice reads every server's settings, through the system account
// when this user may, else from the monitoring port, and returns what a
// production deployment should change.
func serverAdvice(ctx context.Context, nc *nats.Conn, monitor string, replicas int) []string {
	servers, how := readVarz(ctx, nc, monitor)
	if len(servers) == 0 {
		return []string{"could not read the servers' settings (" + how + "); make sure every server runs JetStream with `sync_interval: always`, or acknowledged writes can be lost on power failure"}
	}
	var notes []string
	for _, v := range servers {
		if c := v.JetStream.Config; c != nil && !c.SyncAlways {
			notes = append(notes, fmt.Sprintf("server %s syncs to disk every %v but acknowledges writes at once: a power failure can lose acknowledged leases, jobs and effects; set `jetstream { sync_interval: always }`", v.Name, c.SyncInterval))
		}
	}
	if replicas < 3 {
		notes = append(notes, fmt.Sprintf("replicas is %d: a lost disk loses the lease bucket and the streams; use --replicas 3 on a 3-node cluster in production", replicas))
	}
	return notes
}

func readVarz(ctx context.Context, nc *nats.Conn, monitor string) ([]varz, string) {
	// The system account answers for every server in the cluster.
	inbox := nats.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err == nil {
		defer sub.Unsubscribe()
		if err = nc.PublishRequest("$SYS.REQ.SERVER.PING.VARZ", inbox, nil); err == nil {
			var out []varz
			deadline := time.Now().Add(500 * time.Millisecond)
			for {
				msg, err := sub.NextMsg(time.Until(deadline))
				if err != nil {
					break
				}
				var resp struct {
					Data varz `json:"data"`
				}
				if json.Unmarshal(msg.Data, &resp) == nil && resp.Data.Name != "" {
					out = append(out, resp.Data)
				}
			}
			if len(out) > 0 {
				return out, ""
			}
		}
	}
	if monitor == "" {
		u, err := url.Parse(nc.ConnectedUrl())
		if err != nil || u.Hostname() == "" {
			return nil, "no system account access and no monitoring URL"
		}
		monitor = "http://" + u.Hostname() + ":8222"
	}
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, strings.TrimSuffix(monitor, "/")+"/varz", nil)
	if err != nil {
		return nil, err.Error()
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, "no system account access, and " + monitor + " does not answer; pass --monitor"
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var v varz
	if err := json.Unmarshal(body, &v); err != nil || v.Name == "" {
		return nil, monitor + "/varz is not a NATS monitoring endpoint"
	}
	return []varz{v}, ""
}
