package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/worker"
)

// setUp creates the tables (after dropping an earlier run's), the job
// stream and the lease bucket, and drops jobs an earlier run left.
func setUp(ctx context.Context, js jetstream.JetStream, db *pgxpool.Pool, cfg config) ([]order, uint64, error) {
	if err := resetSchema(ctx, db, cfg.Schema); err != nil {
		return nil, 0, err
	}
	orders, err := seedOrders(ctx, db, cfg.Schema, cfg.Jobs, cfg.Partitions)
	if err != nil {
		return nil, 0, err
	}
	err = worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: cfg.Prefix, Partitions: cfg.Partitions, NoEffects: true})
	if errors.Is(err, worker.ErrStreamConfig) {
		return nil, 0, fmt.Errorf("%w (an earlier run with other settings? pass -prefix with a new name)", err)
	}
	if err != nil {
		return nil, 0, err
	}
	if _, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: cfg.Prefix + "-leases"}); err != nil {
		return nil, 0, err
	}
	// Jobs of an earlier run name orders this run does not have. Purging
	// keeps the stream's sequence numbers, so the progress recorded in the
	// lease bucket stays valid.
	stream, err := js.Stream(ctx, worker.JobsStream(cfg.Prefix))
	if err != nil {
		return nil, 0, err
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return nil, 0, err
	}
	if info.State.Msgs > 0 {
		if err := stream.Purge(ctx); err != nil {
			return nil, 0, fmt.Errorf("drop the jobs of an earlier run: %w", err)
		}
	}
	return orders, info.State.Msgs, nil
}

func enqueue(ctx context.Context, js jetstream.JetStream, cfg config, orders []order) error {
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: cfg.Prefix, Partitions: cfg.Partitions})
	if err != nil {
		return err
	}
	batch := p.Batch()
	for _, o := range orders {
		data, _ := json.Marshal(payJob{Order: o.ID})
		if err := batch.EnqueueTo(ctx, o.Partition, data); err != nil {
			return fmt.Errorf("enqueue %s: %w", o.ID, err)
		}
	}
	if _, err := batch.Wait(ctx); err != nil {
		return fmt.Errorf("enqueue the orders: %w", err)
	}
	return nil
}

// pickZombieOrder picks the order worker-a freezes in: the middle one of
// partition 0, so that worker-a has paid some of the partition's orders
// before it and worker-b pays some after it.
func pickZombieOrder(orders []order) order {
	var p0 []order
	for _, o := range orders {
		if o.Partition == 0 {
			p0 = append(p0, o)
		}
	}
	return p0[len(p0)/2]
}

// ordersBefore lists the orders worker-a pays before it freezes: every
// order of the other partitions, and those of z's partition before z.
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

func hasAll(set map[string]bool, ids []string) bool {
	for _, id := range ids {
		if !set[id] {
			return false
		}
	}
	return true
}

// paidBy returns the orders any of the workers finished; tr is locked.
func paidBy(tr *tracker, names ...string) map[string]bool {
	all := map[string]bool{}
	for _, n := range names {
		for id := range tr.finished[n] {
			all[id] = true
		}
	}
	return all
}

func epochOf(tr *tracker, name string, p leasehold.Partition) leasehold.Epoch {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.epochs[name][p]
}

func holderNote(h string) string {
	if h == "" {
		return ""
	}
	return ", holder " + h
}

func fenceRow(ctx context.Context, db *pgxpool.Pool, schema, scope string, p leasehold.Partition) (leasehold.Epoch, string, error) {
	var e int64
	var holder string
	err := db.QueryRow(ctx, "SELECT epoch, holder FROM "+pgx.Identifier{schema, "leasehold_fence"}.Sanitize()+" WHERE scope = $1 AND partition = $2", scope, int32(p)).Scan(&e, &holder)
	if err != nil {
		return 0, "", fmt.Errorf("read the fence of partition %d: %w", p, err)
	}
	return leasehold.Epoch(e), holder, nil
}

func merchantBalance(ctx context.Context, db *pgxpool.Pool, schema string) (int64, error) {
	var c int64
	err := db.QueryRow(ctx, "SELECT balance_cents FROM "+pgx.Identifier{schema, "accounts"}.Sanitize()+" WHERE id = 'merchant'").Scan(&c)
	if err != nil {
		return 0, fmt.Errorf("read the merchant's balance: %w", err)
	}
	return c, nil
}

func orderRow(ctx context.Context, db *pgxpool.Pool, schema, id string) (string, error) {
	var status string
	var payments int
	var by *string
	var epoch *int64
	err := db.QueryRow(ctx, "SELECT status, payments, paid_by, paid_epoch FROM "+pgx.Identifier{schema, "orders"}.Sanitize()+" WHERE id = $1", id).
		Scan(&status, &payments, &by, &epoch)
	if err != nil {
		return "", fmt.Errorf("read order %s: %w", id, err)
	}
	if by == nil || epoch == nil {
		return fmt.Sprintf("%s, payments = %d", status, payments), nil
	}
	return fmt.Sprintf("%s, payments = %d, paid by %s under epoch %d", status, payments, *by, *epoch), nil
}
