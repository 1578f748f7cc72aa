// Package bench measures what leasehold's safety costs: end-to-end
// throughput and latency beside a hand-written JetStream pipeline with the
// same hops, what tracing costs at each sampling setting, the fence's
// cost per write in each sink beside an unfenced write of the same kind,
// crash fail-over and graceful hand-off of worker processes, scale-out,
// lease load at thousands of partitions, jobs that wait on I/O beside a
// hand-written worker pool, and what an idle partition costs.
//
// The contract:
//
//   - Every figure is the median over Config.Runs runs. Where a baseline
//     exists it is measured in the same run, interleaved with the measured
//     side (A B A B, the order alternating), and the ratio is the median of
//     the per-run ratios, so the machine's drift weighs on both sides alike.
//   - Everything runs on this machine: an embedded NATS server listening on
//     loopback TCP (or, with Config.Cluster, three clustered ones with
//     every stream and bucket at three replicas; with Config.Sync, syncing
//     every write), worker processes started from Config.Binary through
//     internal/fleet, and a throwaway PostgreSQL server when its binaries
//     are installed (the PostgreSQL row is skipped, with a note, when not).
//   - Nothing here asserts a time. Targets are stated in each row's note
//     and judged by whoever reads the table.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"time"
)

// Config configures Run.
type Config struct {
	// Quick runs a reduced set with small sizes and two runs each, fast
	// enough for a test.
	Quick bool
	// Cluster measures on a 3-node JetStream cluster in this process, with
	// every stream and bucket, the baselines' included, at 3 replicas.
	Cluster bool
	// Sync starts the servers with sync_interval: always, so that every
	// write is on disk before it is acknowledged.
	Sync bool
	// Runs is how many runs each figure is the median of. Default 5, or 2
	// with Quick.
	Runs int
	// Binary is the leasehold executable the worker processes run.
	// Default: this process's own executable (which must then act as the
	// leasehold command when started by internal/fleet).
	Binary string
	// Postgres is the connection URL of a PostgreSQL database for the
	// PostgreSQL fence row. Default: start a throwaway server when initdb
	// and postgres are installed; skip the row otherwise.
	Postgres string
	// Scenarios limits the run to the named scenarios (see Scenarios).
	// Default: all of them (a reduced set with Quick).
	Scenarios []string
	// Progress receives one line per finished measurement. Default: none.
	Progress io.Writer
	// Logger receives the components' own logs. Default: discarded below
	// errors.
	Logger *slog.Logger
	// LogDir keeps the worker processes' output. Default: a temporary
	// directory removed afterwards.
	LogDir string

	// runsDefaulted says Runs was left to its default, which the io rows
	// take as 3.
	runsDefaulted bool
}

// Scenarios names what Run can measure, in the order it measures them.
// "aon" is the all-or-none rows of "e2e" alone (jobs of several effects,
// packed and not, against jobs of one), measured once when both are asked
// for.
var Scenarios = []string{"e2e", "aon", "latency", "tracing", "fence", "failover", "scaleout", "scale", "io", "partitions"}

func (c *Config) setDefaults() {
	if c.Runs == 0 {
		c.runsDefaulted = true
		c.Runs = 5
		if c.Quick {
			c.Runs = 2
		}
	}
	if len(c.Scenarios) == 0 {
		c.Scenarios = Scenarios
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	}
}

// Validate reports every problem with c.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	if c.Runs < 1 || c.Runs > 100 {
		errs = append(errs, fmt.Errorf("runs %d: use 1 to 100", c.Runs))
	}
	for _, s := range c.Scenarios {
		if !slices.Contains(Scenarios, s) {
			errs = append(errs, fmt.Errorf("scenario %q: use one of %v", s, Scenarios))
		}
	}
	return errors.Join(errs...)
}

// Row is one line of the result table. Baseline and Ratio are nil where no
// baseline exists; Ratio is Value/Baseline, the median of per-run ratios.
type Row struct {
	Name     string   `json:"name"`
	Value    float64  `json:"value"`
	Unit     string   `json:"unit"`
	Baseline *float64 `json:"baseline"`
	Ratio    *float64 `json:"ratio"`
	// Runs is how many runs the figure is the median of.
	Runs int `json:"runs"`
	// Note says what was measured against what, and the target.
	Note string `json:"note,omitempty"`
}

// Machine describes where the figures were taken.
func Machine() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s %s/%s, %d CPUs (GOMAXPROCS %d), %s", host, runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version())
}

// Run measures the configured scenarios and returns their rows. It stops
// at the first scenario that fails and returns the rows measured so far
// with the error.
func Run(ctx context.Context, cfg Config) ([]Row, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	cfg.setDefaults()
	env, err := startEnv(ctx, &cfg)
	if err != nil {
		return nil, err
	}
	defer env.close()

	var rows []Row
	for _, s := range Scenarios {
		if !slices.Contains(cfg.Scenarios, s) {
			continue
		}
		if ctx.Err() != nil {
			return rows, ctx.Err()
		}
		start := time.Now()
		var got []Row
		switch s {
		case "e2e":
			got, err = env.endToEndAll(ctx)
		case "aon":
			if slices.Contains(cfg.Scenarios, "e2e") {
				continue
			}
			got, err = env.allOrNone(ctx)
		case "latency":
			got, err = env.latency(ctx)
		case "tracing":
			got, err = env.tracingCost(ctx)
		case "fence":
			got, err = env.fenceCost(ctx)
		case "failover":
			got, err = env.failover(ctx)
		case "scaleout":
			got, err = env.scaleOut(ctx)
		case "scale":
			got, err = env.scale(ctx)
		case "io":
			got, err = env.ioRows(ctx)
		case "partitions":
			got, err = env.partitionCost(ctx)
		}
		rows = append(rows, got...)
		if err != nil {
			return rows, fmt.Errorf("bench: %s: %w", s, err)
		}
		env.progress("%s done in %v", s, time.Since(start).Round(time.Millisecond))
	}
	return rows, nil
}

// median returns the middle value (the mean of the two middle ones for an
// even count); 0 for none.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// percentile returns the q-quantile (0..1) of xs by nearest rank.
func percentile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// paired builds a row from interleaved runs: the median of each side and
// the median of the per-run ratios.
func paired(name, unit string, value, baseline []float64, note string) Row {
	ratios := make([]float64, 0, len(value))
	for i := range min(len(value), len(baseline)) {
		if baseline[i] != 0 {
			ratios = append(ratios, value[i]/baseline[i])
		}
	}
	b, r := median(baseline), median(ratios)
	return Row{Name: name, Value: median(value), Unit: unit, Baseline: &b, Ratio: &r, Runs: len(value), Note: note}
}

// single builds a row without a baseline.
func single(name, unit string, values []float64, note string) Row {
	return Row{Name: name, Value: median(values), Unit: unit, Runs: len(values), Note: note}
}
