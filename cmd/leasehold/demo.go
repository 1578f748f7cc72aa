package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/embedded"
)

func newDemo() *cobra.Command {
	var (
		workers    int
		partitions int
		step       time.Duration
	)
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run workers on an embedded NATS server and watch them share partitions",
		Long: `demo starts a NATS server with JetStream inside this process, starts workers
that claim partitions through leases, then adds a worker and stops one, printing
who owns which partition at which epoch after each change.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if workers < 1 || partitions < 1 || partitions > 4096 {
				return fmt.Errorf("use --workers >= 1 and --partitions between 1 and 4096")
			}
			return runDemo(cmd.Context(), cmd.OutOrStdout(), workers, partitions, step)
		},
	}
	cmd.Flags().IntVar(&workers, "workers", 3, "workers to start with")
	cmd.Flags().IntVar(&partitions, "partitions", 16, "partitions to share")
	cmd.Flags().DurationVar(&step, "step", 3*time.Second, "time between changes")
	return cmd
}

type demoWorker struct {
	c      *coordinator.Coordinator
	cancel context.CancelFunc
	done   chan struct{}
}

func runDemo(ctx context.Context, out io.Writer, workers, partitions int, step time.Duration) error {
	dir, err := os.MkdirTemp("", "leasehold-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	srv, err := embedded.Start(embedded.Config{Name: "demo", StoreDir: dir})
	if err != nil {
		return err
	}
	defer srv.WaitForShutdown()
	defer srv.Shutdown()
	nc, err := nats.Connect("", nats.InProcessServer(srv))
	if err != nil {
		return fmt.Errorf("connect to the embedded server: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{MarkerTTL: 5 * time.Second})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "embedded NATS server up; lease bucket %q ready\n", bucket.Name())

	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	var mu sync.Mutex
	running := map[string]*demoWorker{}
	start := func(name string) error {
		c, err := coordinator.New(bucket, coordinator.Config{Worker: name, Partitions: partitions, TTL: 3 * time.Second, Logger: quiet})
		if err != nil {
			return err
		}
		wctx, cancel := context.WithCancel(ctx)
		w := &demoWorker{c: c, cancel: cancel, done: make(chan struct{})}
		go func() { defer close(w.done); _ = c.Run(wctx) }()
		mu.Lock()
		running[name] = w
		mu.Unlock()
		return nil
	}
	stopW := func(name string) {
		mu.Lock()
		w := running[name]
		delete(running, name)
		mu.Unlock()
		w.cancel()
		<-w.done
	}
	defer func() {
		for name := range running {
			stopW(name)
		}
	}()

	show := func(title string) bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(step):
		}
		fmt.Fprintf(out, "\n== %s\n", title)
		tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "WORKER\tPARTITIONS\tEPOCHS")
		mu.Lock()
		for i := range workers + 1 {
			name := fmt.Sprintf("worker-%d", i+1)
			w := running[name]
			if w == nil {
				continue
			}
			var ps, es []string
			for _, l := range w.c.Held() {
				ps = append(ps, l.Partition().String())
				es = append(es, l.Epoch().String())
			}
			fmt.Fprintf(tw, "%s\t%d: %s\t%s\n", name, len(ps), strings.Join(ps, ","), strings.Join(es, ","))
		}
		mu.Unlock()
		tw.Flush()
		return true
	}

	for i := range workers {
		if err := start(fmt.Sprintf("worker-%d", i+1)); err != nil {
			return err
		}
	}
	if !show(fmt.Sprintf("%d workers share %d partitions", workers, partitions)) {
		return nil
	}
	joiner := fmt.Sprintf("worker-%d", workers+1)
	if err := start(joiner); err != nil {
		return err
	}
	if !show(joiner + " joined: only the partitions it needs moved to it") {
		return nil
	}
	stopW("worker-1")
	show("worker-1 left gracefully: its partitions were released and taken at once, with new epochs")
	return nil
}
