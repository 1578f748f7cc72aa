package worker

import (
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
)

// Order is the order a partition keeps among its jobs when it runs several
// at once (Config.PartitionConcurrency).
type Order int

const (
	// OrderKey runs the jobs of one order key (leasehold.HeaderOrderKey:
	// the key Producer.Enqueue partitioned them by) one after another, in
	// stream order, and jobs of different keys side by side. A job without
	// an order key, or with one that does not parse, is ordered by
	// partition: it waits for every earlier job of the partition, and no
	// later job starts before it returns. The default.
	OrderKey Order = iota
	// OrderPartition runs one job of the partition at a time, in stream
	// order, whatever PartitionConcurrency says.
	OrderPartition
	// OrderNone keeps no order: any job may run beside any other, up to
	// PartitionConcurrency.
	OrderNone
)

var orderNames = [...]string{OrderKey: "key", OrderPartition: "partition", OrderNone: "none"}

func (o Order) String() string {
	if o >= 0 && int(o) < len(orderNames) {
		return orderNames[o]
	}
	return fmt.Sprintf("Order(%d)", int(o))
}

// ParseOrder reads an order as String writes it: key, partition or none.
func ParseOrder(s string) (Order, error) {
	for o, name := range orderNames {
		if s == name {
			return Order(o), nil
		}
	}
	return 0, fmt.Errorf("worker: order %q: use key, partition or none", s)
}

// Bounds of a partition's concurrency.
const (
	// MaxPartitionConcurrency bounds Config.PartitionConcurrency.
	MaxPartitionConcurrency = 256
	// maxSpan bounds the jobs a partition tracks from its watermark to the
	// furthest job it fetched: it bounds the jobs it finishes beyond the
	// watermark, which its progress records (coordinator.MaxDone).
	maxSpan = 1024
)

// policy is how a partition runs its jobs: the order it keeps and how many
// may run at once.
type policy struct {
	order       Order
	concurrency int // jobs of the partition at once, 1 for OrderPartition
}

// floored reports whether the partition may have more than one job in
// flight: its finals then carry its watermark (leasehold.HeaderFloor).
func (p policy) floored() bool { return p.concurrency > 1 }

// partitionPolicy is the one place that resolves how a partition runs
// its jobs from the configuration; settings per kind would override it
// here. A job that runs counts against MaxInFlight as well as one whose
// effects are awaited, so MaxInFlight 1 runs one job at a time and starts
// the next once the one before is acknowledged, whatever the order.
func (c *Config) partitionPolicy() policy {
	p := policy{order: c.Order, concurrency: min(c.PartitionConcurrency, max(c.MaxInFlight, 1))}
	if p.order == OrderPartition || p.concurrency < 1 {
		p.concurrency = 1
	}
	return p
}

// span is how many jobs a partition tracks at most from its watermark to
// the furthest job it fetched: beyond it, fetching pauses until the
// watermark moves (a job that does not finish stops the intake after that
// many, and the stall report shows it).
func (c *Config) span() int {
	return min(max(c.MaxInFlight, 4*c.partitionPolicy().concurrency), maxSpan)
}

// laneKey names the queue a job waits in: the jobs of one lane run one
// after another in stream order.
type laneKey struct {
	kind laneKind
	key  uint64 // the order key, or for laneAlone the job's sequence
}

type laneKind uint8

const (
	laneKeyed     laneKind = iota // the jobs of one order key
	lanePartition                 // the jobs ordered by partition: each waits for all before it
	laneAlone                     // a job with no order to keep (OrderNone)
)

// laneOf is the lane of the job at seq with headers h under order o. A
// malformed order key is reported through bad, once per runner.
func laneOf(o Order, seq uint64, h nats.Header, bad func(error)) laneKey {
	switch o {
	case OrderPartition:
		return laneKey{kind: laneKeyed}
	case OrderNone:
		return laneKey{kind: laneAlone, key: seq}
	}
	key, ok, err := leasehold.OrderKeyFromHeader(h)
	if err != nil {
		bad(err)
	}
	if !ok {
		return laneKey{kind: lanePartition}
	}
	return laneKey{kind: laneKeyed, key: key}
}
