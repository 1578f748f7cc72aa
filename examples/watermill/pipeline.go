package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// topic is where the workers publish and the downstream router reads.
const topic = "shipments"

// shipJob is a job's payload, and also the message the job publishes.
type shipJob struct {
	Order string `json:"order"`
}

// upstream is the leasehold side: a job handler that publishes one
// Watermill message per job through a stamping publisher.
type upstream struct {
	pub    message.Publisher // wmstamp.NewPublisher over the pub/sub
	zombie *zombie           // the example's stagecraft; nil in real code
}

// handle ships one order. The message is created with the handler's
// context, which carries the leasehold job: that is how the stamping
// publisher finds the partition, the epoch and the next idempotency key.
func (u *upstream) handle(ctx context.Context, job *worker.Job, o shipJob) error {
	err := u.ship(ctx, o)
	if u.zombie.isZombie(job.Lease.Holder, o.Order) {
		// Back from its stuck publish, the zombie tries once more.
		u.zombie.report(err, u.ship(ctx, o))
	}
	return err
}

func (u *upstream) ship(ctx context.Context, o shipJob) error {
	payload, _ := json.Marshal(o)
	msg := message.NewMessageWithContext(ctx, watermill.NewUUID(), payload)
	return u.pub.Publish(topic, msg)
}

// barriers is a worker.Fence that tells the downstream about a take-over.
// When a worker acquires a partition, before its first job, it publishes a
// barrier into the topic: a message with the new epoch's stamp, the
// Leasehold-Barrier header and no payload. The fencing middleware raises
// the partition's maximum when it reads it, so the previous holder's later
// messages are dropped even before the new holder publishes anything. It
// is what the worker's BarrierSubjects does for JetStream effect logs.
type barriers struct {
	pub message.Publisher // the plain pub/sub: a barrier is stamped here
}

func (b barriers) Advance(ctx context.Context, l leasehold.Lease) error {
	msg := message.NewMessageWithContext(ctx, watermill.NewUUID(), nil)
	l.Stamp(leasehold.BarrierKey(l.Scope, l.Partition, l.Epoch)).SetMetadata(msg.Metadata)
	msg.Metadata.Set(leasehold.HeaderBarrier, "1")
	if err := b.pub.Publish(topic, msg); err != nil {
		return fmt.Errorf("publish the barrier of partition %d epoch %d: %w", l.Partition, l.Epoch, err)
	}
	return nil
}

// shipment is what the downstream recorded for one message.
type shipment struct {
	Order  string
	Stamp  leasehold.Stamp
	Repeat bool // its idempotency key was shipped before
}

// warehouse is the downstream handler's state: shipments by idempotency
// key, so that a job re-run after a fail-over ships once.
type warehouse struct {
	tr *tracker
}

// ship is the downstream Watermill handler. The fencing middleware runs
// it only for messages whose epoch is current.
func (w *warehouse) ship(msg *message.Message) error {
	st, err := leasehold.StampFromMetadata(msg.Metadata)
	if err != nil {
		return err // the middleware refuses such messages first
	}
	var o shipJob
	if err := json.Unmarshal(msg.Payload, &o); err != nil {
		return fmt.Errorf("message %s: %w", msg.UUID, err)
	}
	w.tr.update(func() {
		_, seen := w.tr.byKey[st.Key]
		w.tr.shipments = append(w.tr.shipments, shipment{Order: o.Order, Stamp: st, Repeat: seen})
		w.tr.byKey[st.Key] = o.Order
	})
	return nil
}

// network stands in for the wire between a worker and the broker. It
// holds back the one message the zombie is to send late, as a network that
// hangs would, and delivers it when told.
type network struct {
	message.Publisher
	zombie *zombie
}

func (n *network) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if err := n.zombie.hold(m); err != nil {
			return err
		}
	}
	return n.Publisher.Publish(topic, msgs...)
}

// zombie is the example's stagecraft: it makes one worker's message for
// one order hang in the network after it has been stamped, and records
// what the worker's publishes came to. A real handler has none of it.
type zombie struct {
	worker string // the worker whose message hangs
	order  string // the order it is about

	held chan leasehold.Stamp // receives the stuck message's stamp
	wake chan struct{}        // closed to deliver it
	done chan zombieResult    // what the zombie's publishes came to

	used     atomic.Bool
	aborted  atomic.Bool
	wakeOnce sync.Once
}

type zombieResult struct {
	late  error // the stuck publish, once delivered
	retry error // the publish the zombie tries next
}

func newZombie(worker, order string) *zombie {
	return &zombie{
		worker: worker,
		order:  order,
		held:   make(chan leasehold.Stamp, 1),
		wake:   make(chan struct{}),
		done:   make(chan zombieResult, 1),
	}
}

func (z *zombie) isZombie(holder, order string) bool {
	return z != nil && holder == z.worker && order == z.order
}

// hold blocks the zombie's first message until wakeUp.
func (z *zombie) hold(m *message.Message) error {
	if z == nil {
		return nil
	}
	var o shipJob
	_ = json.Unmarshal(m.Payload, &o)
	if m.Metadata.Get(leasehold.HeaderWorker) != z.worker || o.Order != z.order || !z.used.CompareAndSwap(false, true) {
		return nil
	}
	st, _ := leasehold.StampFromMetadata(m.Metadata)
	z.held <- st
	<-z.wake
	if z.aborted.Load() {
		return errAborted
	}
	return nil
}

func (z *zombie) report(late, retry error) {
	select {
	case z.done <- zombieResult{late: late, retry: retry}:
	default: // reported already
	}
}

// wakeUp delivers the stuck message; it is safe to call more than once.
func (z *zombie) wakeUp() { z.wakeOnce.Do(func() { close(z.wake) }) }

// abort drops the stuck message, when the example stops early.
func (z *zombie) abort() {
	z.aborted.Store(true)
	z.wakeUp()
}

var errAborted = errors.New("the example stopped before the stuck message was delivered")
