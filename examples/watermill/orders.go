package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/worker"
)

// frozenDrain is how long worker-a's shutdown waits for its stuck handler
// before it gives the partition up.
const frozenDrain = time.Second

type order struct {
	ID        string
	Partition leasehold.Partition
}

// sortOrders sorts order IDs by number: o-2 before o-10.
func sortOrders(ids []string) []string {
	out := slices.Clone(ids)
	slices.SortFunc(out, func(a, b string) int {
		na, _ := strconv.Atoi(strings.TrimPrefix(a, "o-"))
		nb, _ := strconv.Atoi(strings.TrimPrefix(b, "o-"))
		return na - nb
	})
	return out
}

// byKeyOrders returns the orders shipped at least once; t is locked.
func (t *tracker) byKeyOrders() map[string]bool {
	out := map[string]bool{}
	for _, o := range t.byKey {
		out[o] = true
	}
	return out
}

// setUp creates the job stream and the lease bucket, and drops jobs an
// earlier run left.
func setUp(ctx context.Context, js jetstream.JetStream, cfg config) (uint64, error) {
	err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: cfg.Prefix, Partitions: cfg.Partitions, NoEffects: true})
	if errors.Is(err, worker.ErrStreamConfig) {
		return 0, fmt.Errorf("%w (an earlier run with other settings? pass -prefix with a new name)", err)
	}
	if err != nil {
		return 0, err
	}
	if _, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: cfg.Prefix + "-leases"}); err != nil {
		return 0, err
	}
	// Purging keeps the stream's sequence numbers, so the progress
	// recorded in the lease bucket stays valid.
	stream, err := js.Stream(ctx, worker.JobsStream(cfg.Prefix))
	if err != nil {
		return 0, err
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return 0, err
	}
	if info.State.Msgs > 0 {
		if err := stream.Purge(ctx); err != nil {
			return 0, fmt.Errorf("drop the jobs of an earlier run: %w", err)
		}
	}
	return info.State.Msgs, nil
}

func enqueue(ctx context.Context, js jetstream.JetStream, cfg config, orders []order) error {
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: cfg.Prefix, Partitions: cfg.Partitions})
	if err != nil {
		return err
	}
	batch := p.Batch()
	for _, o := range orders {
		data, _ := json.Marshal(shipJob{Order: o.ID})
		if err := batch.EnqueueTo(ctx, o.Partition, data); err != nil {
			return fmt.Errorf("enqueue %s: %w", o.ID, err)
		}
	}
	if _, err := batch.Wait(ctx); err != nil {
		return fmt.Errorf("enqueue the orders: %w", err)
	}
	return nil
}

// pickZombieOrder picks the order whose message hangs: the middle one of
// partition 0, so that worker-a has shipped some of the partition's orders
// before it and worker-b ships some after it.
func pickZombieOrder(orders []order) order {
	var p0 []order
	for _, o := range orders {
		if o.Partition == 0 {
			p0 = append(p0, o)
		}
	}
	return p0[len(p0)/2]
}

// ordersBefore lists the orders worker-a ships before its message hangs:
// every order of the other partitions, and those of z's partition before z.
func ordersBefore(orders []order, z order) []string {
	var ids []string
	seen := false
	for _, o := range orders {
		if o.ID == z.ID {
			seen = true
		}
		if o.Partition != z.Partition || !seen {
			ids = append(ids, o.ID)
		}
	}
	return ids
}

func hasAll(have []string, want []string) bool {
	set := map[string]bool{}
	for _, id := range have {
		set[id] = true
	}
	for _, id := range want {
		if !set[id] {
			return false
		}
	}
	return true
}

// count says "1 order", "2 orders".
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// script prints the narration: numbered steps, indented lines. It keeps
// the first write error.
type script struct {
	w   io.Writer
	n   int
	err error
}

func (s *script) printf(format string, args ...any) {
	if s.err == nil {
		_, s.err = fmt.Fprintf(s.w, format, args...)
	}
}

func (s *script) step(title string) {
	s.n++
	s.printf("\n%d. %s\n", s.n, title)
}

func (s *script) say(format string, args ...any) { s.printf("   "+format+"\n", args...) }
