package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/worker"
)

// metaPartitions is the job stream's metadata entry that records its
// partition count (worker.ProvisionJobs writes it; it never changes).
const metaPartitions = "leasehold.partitions"

// partitionsHelp is the help text of --partitions on the commands that read
// the count from the job stream.
const partitionsHelp = "partitions of the job stream (default: the count the job stream records; given, it must match it)"

// recordedPartitions returns the partition count the job stream of prefix
// records, or 0 when there is no job stream.
func recordedPartitions(ctx context.Context, js jetstream.JetStream, prefix string) (int, error) {
	name := worker.JobsStream(prefix)
	s, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("look up the job stream %s: %w", name, err)
	}
	v := s.CachedInfo().Config.Metadata[metaPartitions]
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > leasehold.MaxPartitions {
		return 0, fmt.Errorf("the job stream %s records no partition count (metadata %s=%q): it was not provisioned by leasehold init", name, metaPartitions, v)
	}
	return n, nil
}

// resolvePartitions is the partition count a command works with: the one
// the job stream records. given is --partitions (0 when left out); given
// and different from the stream's, it is an error that says both.
// Without a job stream, given is used, or def when it is 0 too (def 0:
// the job stream must exist).
func (n *natsFlags) resolvePartitions(ctx context.Context, js jetstream.JetStream, given, def int) (int, error) {
	if given < 0 || given > leasehold.MaxPartitions {
		return 0, fmt.Errorf("--partitions %d: use 1 to %d, or leave it out to use the job stream's", given, leasehold.MaxPartitions)
	}
	rec, err := recordedPartitions(ctx, js, n.prefix)
	if err != nil {
		return 0, err
	}
	switch {
	case rec > 0 && given > 0 && given != rec:
		return 0, fmt.Errorf("--partitions %d: the job stream %s has %d partitions, and the count cannot change; leave --partitions out to use the stream's %d",
			given, worker.JobsStream(n.prefix), rec, rec)
	case rec > 0:
		return rec, nil
	case given > 0:
		return given, nil
	case def > 0:
		return def, nil
	}
	return 0, fmt.Errorf("there is no job stream %s to read the partition count from: run `leasehold init --prefix %s` first (or check --prefix%s)",
		worker.JobsStream(n.prefix), n.prefix, n.knownPrefixes(ctx, js))
}

// openLeaseBucket opens the lease bucket of --prefix (or --bucket) and
// checks that it serves the job stream of --prefix, so that a wrong prefix
// is an error rather than another stream's table.
func (n *natsFlags) openLeaseBucket(ctx context.Context, js jetstream.JetStream) (*coordinator.Bucket, error) {
	b, err := coordinator.OpenBucket(ctx, js, n.leaseBucket())
	if err != nil {
		if n.bucket == "" {
			if _, serr := js.Stream(ctx, "KV_"+n.leaseBucket()); errors.Is(serr, jetstream.ErrStreamNotFound) {
				return nil, fmt.Errorf("--prefix %s: there is no lease bucket %s for it%s: %w", n.prefix, n.leaseBucket(), n.knownPrefixes(ctx, js), err)
			}
		}
		return nil, err
	}
	if b.Scope() != n.prefix {
		return nil, fmt.Errorf("--prefix %s: lease bucket %s serves the job stream of prefix %q: pass --prefix %s, or the bucket of prefix %s",
			n.prefix, b.Name(), b.Scope(), b.Scope(), n.prefix)
	}
	return b, nil
}

// knownPrefixes names the prefixes of the job streams on the server, for
// an error about a prefix that has none, as "; the server has job streams
// of prefix a, b"; "" when it cannot tell.
func (n *natsFlags) knownPrefixes(ctx context.Context, js jetstream.JetStream) string {
	var found []string
	names := js.StreamNames(ctx)
	for name := range names.Name() {
		if p, ok := strings.CutSuffix(name, "-jobs"); ok && len(found) < 20 {
			found = append(found, p)
		}
	}
	if names.Err() != nil || len(found) == 0 {
		return ""
	}
	slices.Sort(found)
	return "; the server has job streams of prefix " + strings.Join(found, ", ")
}
