package bench

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/retry"
)

// acquireFloor is the least a cold start of partitions over members costs
// in writes on this server configuration, without leasehold: each
// acquisition takes a partition's lease key and then writes its fence
// record, both compare-and-set on a key not yet written, each in a bucket
// of its own as leasehold keeps them. Every member writes its share from a
// connection of its own, pipelined (every write in flight at once, as far
// as the publish window lets), or, with batch > 0, in atomic batches of
// that many partitions, one batch in flight per writer (at most 32
// writers: the server keeps at most 50 atomic batches open per stream). It
// returns the seconds from the first write until every write is
// acknowledged.
func (e *env) acquireFloor(ctx context.Context, prefix string, partitions, members, batch int, bound time.Duration) (float64, error) {
	nc, js, err := e.connect("bench floor " + prefix)
	if err != nil {
		return 0, err
	}
	defer e.release(nc)
	buckets := []string{prefix + "-leases", prefix + "-fences"}
	for _, b := range buckets {
		_, err := retry.Value(ctx, func(ctx context.Context) (jetstream.KeyValue, error) {
			return js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, History: 1, Storage: jetstream.FileStorage, Replicas: e.replicas()})
		})
		if err != nil {
			return 0, fmt.Errorf("floor bucket %s: %w", b, err)
		}
		if batch > 0 {
			if err := allowAtomic(ctx, js, "KV_"+b); err != nil {
				return 0, err
			}
		}
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		for _, b := range buckets {
			_ = js.DeleteKeyValue(dctx, b)
		}
	}()
	if err := e.waitReplicas(ctx, js, "KV_"+buckets[0], "KV_"+buckets[1]); err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	if batch > 0 {
		// The server keeps at most 50 atomic batches open per stream by
		// default: 32 writers, one batch each, stay below it.
		members = min(members, 32)
	}
	conns := make([]jetstream.JetStream, members)
	for m := range members {
		c, mjs, err := e.connect(fmt.Sprintf("bench floor %s-%d", prefix, m), jetstream.WithPublishAsyncMaxPending(2*(partitions/members+1)))
		if err != nil {
			return 0, err
		}
		defer e.release(c)
		conns[m] = mjs
	}
	var wg sync.WaitGroup
	errs := make([]error, members)
	t0 := time.Now()
	for m := range members {
		var mine []int
		for p := m; p < partitions; p += members {
			mine = append(mine, p)
		}
		wg.Go(func() {
			if batch > 0 {
				errs[m] = floorBatched(ctx, conns[m], buckets, mine, batch)
			} else {
				errs[m] = floorPipelined(ctx, conns[m], buckets, mine)
			}
		})
	}
	wg.Wait()
	took := time.Since(t0).Seconds()
	for _, err := range errs {
		if err != nil {
			return 0, err
		}
	}
	return took, nil
}

// floorPipelined creates every partition's lease key, then, as each is
// acknowledged, its fence record. The connection's publish window holds
// all of them, so no publish waits for room.
func floorPipelined(ctx context.Context, js jetstream.JetStream, buckets []string, parts []int) error {
	leases := make([]jetstream.PubAckFuture, len(parts))
	for i, p := range parts {
		f, err := js.PublishAsync("$KV."+buckets[0]+".partition."+strconv.Itoa(p), []byte("lease"), jetstream.WithExpectLastSequencePerSubject(0))
		if err != nil {
			return err
		}
		leases[i] = f
	}
	fences := make([]jetstream.PubAckFuture, len(parts))
	for i, f := range leases {
		if err := awaitAck(ctx, f); err != nil {
			return err
		}
		g, err := js.PublishAsync("$KV."+buckets[1]+".fence."+strconv.Itoa(parts[i]), []byte("fence"), jetstream.WithExpectLastSequencePerSubject(0))
		if err != nil {
			return err
		}
		fences[i] = g
	}
	for _, f := range fences {
		if err := awaitAck(ctx, f); err != nil {
			return err
		}
	}
	return nil
}

// floorBatched writes the lease keys of batch partitions in one atomic
// batch, then their fence records in another.
func floorBatched(ctx context.Context, js jetstream.JetStream, buckets []string, parts []int, batch int) error {
	nc := js.Conn()
	for len(parts) > 0 {
		n := min(batch, len(parts))
		for _, kind := range []struct{ bucket, key string }{{buckets[0], "partition."}, {buckets[1], "fence."}} {
			msgs := make([]*nats.Msg, n)
			for i, p := range parts[:n] {
				m := nats.NewMsg("$KV." + kind.bucket + "." + kind.key + strconv.Itoa(p))
				m.Data = []byte("x")
				m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, "0")
				msgs[i] = m
			}
			if err := atomicPublish(ctx, nc, msgs); err != nil {
				return err
			}
		}
		parts = parts[n:]
	}
	return nil
}

func awaitAck(ctx context.Context, f jetstream.PubAckFuture) error {
	select {
	case <-f.Ok():
		return nil
	case err := <-f.Err():
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}
