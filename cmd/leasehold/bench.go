package main

import (
	"fmt"
	"os"
	"runtime/pprof"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/cmd/leasehold/internal/bench"
)

func newBench() *cobra.Command {
	var (
		cfg        bench.Config
		asJSON     bool
		cpuProfile string
		memProfile string
		poolWorker string
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure leasehold against raw JetStream, fail-over and scale",
		Long: `bench measures, on this machine, what leasehold's safety costs: end-to-end
throughput and latency beside a hand-written JetStream pipeline with the same
hops and acks, what tracing costs at the default sampler and with every trace
sampled, the fence's cost per write in the memory, KV and PostgreSQL sinks
beside unfenced writes, crash fail-over (SIGKILL) and graceful hand-off
(SIGTERM) of worker processes, scale-out under load, 4096 partitions over 32
worker processes, jobs whose handler waits 50 ms beside a hand-written
JetStream worker pool (--only io), and what an idle partition costs the
server and the workers (--only partitions). It starts its own NATS server (and
PostgreSQL, when installed) and its own worker processes; it needs no
deployment.

Every figure is the median of several runs (see RUNS); where a baseline exists
it is measured in the same run, interleaved, and RATIO is the median of the
per-run ratios, which holds on a noisy machine where absolute numbers drift.
--quick runs a reduced set with small sizes in well under a minute.

By default the server is one node with one replica and nats-server's default
sync (every 2 minutes). --cluster runs every row on a 3-node cluster in this
process with every stream and bucket at 3 replicas, and --sync starts the
servers with sync_interval: always; together they are the configuration
deploy/helm recommends. The baselines run in the same configuration.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if poolWorker != "" {
				return bench.RunPoolWorker(cmd.Context(), poolWorker)
			}
			if cpuProfile != "" {
				f, err := os.Create(cpuProfile)
				if err != nil {
					return err
				}
				defer f.Close()
				if err := pprof.StartCPUProfile(f); err != nil {
					return err
				}
				defer pprof.StopCPUProfile()
			}
			cfg.Progress = cmd.ErrOrStderr()
			rows, err := bench.Run(cmd.Context(), cfg)
			out := cmd.OutOrStdout()
			if asJSON {
				if werr := bench.WriteJSON(out, rows); werr != nil && err == nil {
					err = werr
				}
			} else {
				fmt.Fprintf(out, "machine: %s\nservers: %s\n\n", bench.Machine(), cfg.Configuration())
				if werr := bench.WriteTable(out, rows); werr != nil && err == nil {
					err = werr
				}
			}
			if memProfile != "" {
				if perr := writeHeapProfile(memProfile); perr != nil && err == nil {
					err = perr
				}
			}
			return err
		},
	}
	fs := cmd.Flags()
	fs.BoolVar(&cfg.Quick, "quick", false, "run a reduced set with small sizes, fast enough for a test")
	fs.BoolVar(&asJSON, "json", false, "print a JSON array of rows {name, value, unit, baseline, ratio, runs, note}")
	fs.BoolVar(&cfg.Cluster, "cluster", false, "measure on a 3-node cluster in this process, every stream and bucket at 3 replicas")
	fs.BoolVar(&cfg.Sync, "sync", false, "start the servers with sync_interval: always (fsync before every acknowledgement)")
	fs.IntVar(&cfg.Runs, "runs", 0, "runs per figure (default 5, 2 with --quick)")
	fs.StringSliceVar(&cfg.Scenarios, "only", nil, fmt.Sprintf("measure only these scenarios (%v)", bench.Scenarios))
	fs.StringVar(&cfg.Postgres, "postgres-url", "", "PostgreSQL database for the PostgreSQL fence row (default: start a throwaway server when installed)")
	fs.StringVar(&cfg.LogDir, "log-dir", "", "keep the worker processes' output in this directory")
	fs.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of this process (server, pipelines, sinks) to the file")
	fs.StringVar(&memProfile, "memprofile", "", "write an allocation profile of this process to the file")
	fs.StringVar(&poolWorker, "io-pool-worker", "", "run one process of the io rows' baseline pool with this JSON spec (the bench starts these itself)")
	_ = fs.MarkHidden("io-pool-worker")
	return cmd
}

func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return pprof.Lookup("allocs").WriteTo(f, 0)
}
