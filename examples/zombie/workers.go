package main

import (
	"context"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
)

// worker is one of the walk-through's two workers: its own connection, its
// own view of the lease bucket and its own handle on the sink, as a
// separate process would have.
type worker struct {
	name  string
	nc    *nats.Conn
	coord *coordinator.Coordinator
	sink  *kvsink.Sink
}

func newWorker(ctx context.Context, srv *natsServer, cfg config, name string) (*worker, error) {
	nc, err := srv.connect(name)
	if err != nil {
		return nil, err
	}
	w := &worker{name: name, nc: nc}
	js, err := jetstream.New(nc)
	if err == nil {
		var b *coordinator.Bucket
		if b, err = coordinator.OpenBucket(ctx, js, cfg.Name+"-leases"); err == nil {
			w.coord, err = coordinator.New(b, coordinator.Config{Worker: name, TTL: cfg.TTL, Logger: cfg.Logger})
		}
	}
	if err == nil {
		w.sink, err = kvsink.New(ctx, js, kvsink.Config{Bucket: cfg.Name + "-effects", Logger: cfg.Logger})
	}
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return w, nil
}

// write applies "accounts.alice = balance" through the worker's sink,
// stamped as the effect of job seq under lease l, and says what the sink
// decided.
func (w *worker) write(ctx context.Context, s *script, l leasehold.Lease, seq uint64, balance int) error {
	st := l.Stamp(leasehold.EffectKey(l.Scope, part, seq, 0))
	s.say("%s: Apply %s = %d", w.name, account, balance)
	s.say("          stamp: scope %s, partition %d, epoch %d, key %s", st.Scope, st.Partition, st.Epoch, st.Key)
	err := w.sink.Apply(ctx, sink.Effect{Stamp: st, Subject: account, Data: []byte(strconv.Itoa(balance))})
	if err == nil {
		s.say("          -> accepted")
	}
	return err
}
