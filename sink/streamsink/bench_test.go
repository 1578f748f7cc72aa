package streamsink_test

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// BenchmarkRunnerVsRaw compares the runner's throughput with a raw
// pipeline doing the same transport work without fencing: fetch batches,
// republish each message with its Nats-Msg-Id, wait for the PubAcks, ack.
// Each iteration runs both over the same number of 256-byte effects on the
// same embedded server, and the benchmark reports the median rate of each
// and their ratio.
func BenchmarkRunnerVsRaw(b *testing.B) {
	const n = 2000
	srv := natstest.Start(b)
	ctx := context.Background()
	js := srv.JetStream(b)
	data := make([]byte, 256)
	publish := func(subject string, round int) uint64 {
		var last jetstream.PubAckFuture
		for i := range n {
			h := nats.Header{}
			leasehold.Stamp{Scope: "bench", Partition: leasehold.Partition(i % 16), Epoch: 5, Acquisition: "a5", Key: fmt.Sprintf("%s.%d.%d", subject, round, i)}.SetHeader(h)
			f, err := js.PublishMsgAsync(&nats.Msg{Subject: subject, Header: h, Data: data})
			if err != nil {
				b.Fatal(err)
			}
			last = f
		}
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(time.Minute):
			b.Fatal("publish stalled")
		}
		ack := <-last.Ok()
		return ack.Sequence
	}
	for _, s := range []jetstream.StreamConfig{
		{Name: "raw-in", Subjects: []string{"raw.in.>"}},
		{Name: "raw-out", Subjects: []string{"raw.out.>"}},
	} {
		if _, err := js.CreateStream(ctx, s); err != nil {
			b.Fatal(err)
		}
	}
	rawCons, err := js.CreateOrUpdateConsumer(ctx, "raw-in", jetstream.ConsumerConfig{Durable: "raw", AckPolicy: jetstream.AckExplicitPolicy, MaxAckPending: 400})
	if err != nil {
		b.Fatal(err)
	}
	cfg := streamsink.Config{Prefix: "bench", Provision: true, Logger: quiet()}
	if _, err := streamsink.New(ctx, js, cfg); err != nil {
		b.Fatal(err)
	}
	var raw, fenced []float64
	round := 0
	for b.Loop() {
		round++
		publish("raw.in.x", round)
		t0 := time.Now()
		rawPipeline(b, js, rawCons, n)
		raw = append(raw, n/time.Since(t0).Seconds())

		last := publish("bench.out.x", round)
		r, err := streamsink.New(ctx, js, cfg)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		rr := run(b, r)
		if err := r.WaitPosition(ctx, last); err != nil {
			b.Fatal(err)
		}
		fenced = append(fenced, n/time.Since(t1).Seconds())
		if err := rr.stop(); err != nil {
			b.Fatal(err)
		}
	}
	mr, mf := medianF(raw), medianF(fenced)
	b.ReportMetric(mr, "raw-msgs/s")
	b.ReportMetric(mf, "runner-msgs/s")
	b.ReportMetric(mf/mr, "ratio")
}

func rawPipeline(b *testing.B, js jetstream.JetStream, cons jetstream.Consumer, n int) {
	done := 0
	for done < n {
		batch, err := cons.FetchNoWait(100)
		if err != nil {
			b.Fatal(err)
		}
		var msgs []jetstream.Msg
		for m := range batch.Messages() {
			msgs = append(msgs, m)
		}
		futures := make([]jetstream.PubAckFuture, 0, len(msgs))
		for _, m := range msgs {
			out := nats.NewMsg("raw.out.x")
			out.Header = m.Headers()
			st, _ := leasehold.StampFromHeader(m.Headers())
			out.Header.Set(jetstream.MsgIDHeader, st.Key)
			out.Data = m.Data()
			f, err := js.PublishMsgAsync(out)
			if err != nil {
				b.Fatal(err)
			}
			futures = append(futures, f)
		}
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				b.Fatal(err)
			}
		}
		for _, m := range msgs {
			_ = m.Ack()
		}
		done += len(msgs)
	}
}

func medianF(v []float64) float64 {
	sort.Float64s(v)
	return v[len(v)/2]
}
