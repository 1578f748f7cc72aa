package worker

import (
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nuid"

	"github.com/leasehold/leasehold"
)

// EnqueueOption adjusts one enqueue.
type EnqueueOption func(*enqueueOpts)

type enqueueOpts struct {
	id     string
	header nats.Header
	kind   string
	key    []byte    // the typed Enqueue's partition key
	codec  Codec     // the typed Enqueue's codec
	at     time.Time // a delayed job's due time (EnqueueAt, EnqueueIn)
	// order is the job's leasehold.HeaderOrderKey: the digest of the key
	// Enqueue partitioned it by; "" for EnqueueTo's jobs.
	order string
	// unique is the job's uniqueness (Unique, UniqueKey), nil for none.
	unique *uniqueness
}

// WithOrderKey gives the job the order key of key (see
// leasehold.HeaderOrderKey): where a partition runs several jobs at once,
// the jobs of one order key run one after another, in the order they were
// stored. Enqueue gives every job the order key of its partition key; this
// is for EnqueueTo, whose jobs otherwise have none, and for an Enqueue
// that orders its jobs by another key than the one that picks their
// partition (jobs of one order key on different partitions are not kept
// in order with each other).
func WithOrderKey(key []byte) EnqueueOption {
	return func(o *enqueueOpts) { o.order = leasehold.OrderKey(key) }
}

// enqueueOptions applies opts, giving the job a random ID unless one is
// set.
func enqueueOptions(opts []EnqueueOption) enqueueOpts {
	if len(opts) == 0 {
		return enqueueOpts{id: nuid.Next()} // no options: nothing escapes
	}
	return applyEnqueueOptions(&enqueueOpts{}, opts)
}

// enqueueOptionsKeyed is enqueueOptions(WithOrderKey(key), opts...),
// without the closure and the slice that takes.
func enqueueOptionsKeyed(key []byte, opts []EnqueueOption) enqueueOpts {
	if len(opts) == 0 {
		return enqueueOpts{id: nuid.Next(), order: leasehold.OrderKey(key)}
	}
	return applyEnqueueOptions(&enqueueOpts{order: leasehold.OrderKey(key)}, opts)
}

func applyEnqueueOptions(o *enqueueOpts, opts []EnqueueOption) enqueueOpts {
	for _, opt := range opts {
		opt(o)
	}
	if o.id == "" {
		o.id = nuid.Next()
	}
	return *o
}

// JobID sets the job's ID, its Nats-Msg-Id: a job enqueued twice with the
// same ID within the stream's duplicate window is stored once. Without it,
// each enqueue gets a random ID that its own retries reuse.
func JobID(id string) EnqueueOption { return func(o *enqueueOpts) { o.id = id } }

// WithHeader adds headers to the job. Handlers see them in Job.Header.
// Leasehold-* headers are leasehold's to write, and an enqueue that gives
// one (but Leasehold-Kind) fails; so do Nats-* directives that would purge,
// schedule or expire jobs.
func WithHeader(h nats.Header) EnqueueOption { return func(o *enqueueOpts) { o.header = h } }
