package httpsink_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/httpsink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// benchConcurrency is the requests in flight, for the relay and the plain
// client alike.
const benchConcurrency = 8

// benchRelay is a relay to url with benchConcurrency requests at once,
// over a transport that keeps as many connections to it.
func benchRelay(b *testing.B, bucket *coordinator.Bucket, url string) *httpsink.Relay {
	b.Helper()
	c, err := coordinator.New(bucket, coordinator.Config{Worker: "relay", Logger: quiet()})
	if err != nil {
		b.Fatal(err)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = benchConcurrency
	b.Cleanup(tr.CloseIdleConnections)
	r, err := httpsink.New(httpsink.Config{URL: url, Coordinator: c, Concurrency: benchConcurrency, Transport: tr, Logger: quiet()})
	if err != nil {
		b.Fatal(err)
	}
	return r
}

// okServer answers every request 200 after reading its body, behind a
// Verifier when verify is set.
func okServer(b *testing.B, verify bool) *httptest.Server {
	var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.Copy(io.Discard, r.Body) })
	if verify {
		v, err := httpsink.NewVerifier(httpsink.VerifierConfig{Logger: quiet()})
		if err != nil {
			b.Fatal(err)
		}
		h = v.Wrap(h)
	}
	srv := httptest.NewServer(h)
	b.Cleanup(srv.Close)
	return srv
}

// BenchmarkPlainClient is the baseline: benchConcurrency goroutines post
// 256-byte bodies with an http.Client, nothing else.
func BenchmarkPlainClient(b *testing.B) {
	srv := okServer(b, false)
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = benchConcurrency
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	body := bytes.Repeat([]byte("x"), 256)
	b.ResetTimer()
	var wg sync.WaitGroup
	next := make(chan int)
	for range benchConcurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				req, _ := http.NewRequest(http.MethodPost, srv.URL, bytes.NewReader(body))
				req.Header.Set("Idempotency-Key", fmt.Sprintf(`"k%d"`, i))
				resp, err := client.Do(req)
				if err != nil {
					b.Error(err)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	for i := range b.N {
		next <- i
	}
	close(next)
	wg.Wait()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
}

// BenchmarkRelayDeliverBatch sends b.N effects through Relay.DeliverBatch
// in batches of 128 over 16 partitions (so 16 chains, benchConcurrency at
// once), as the runner hands them over: what a request costs in the relay
// beside the plain client. /verifier adds the receiver's Verifier with
// its memory stores.
func BenchmarkRelayDeliverBatch(b *testing.B) {
	for _, verify := range []bool{false, true} {
		name := "plain-receiver"
		if verify {
			name = "verifier"
		}
		b.Run(name, func(b *testing.B) {
			srv := okServer(b, verify)
			js := natstest.Start(b).JetStream(b)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "bench-leases"})
			if err != nil {
				b.Fatal(err)
			}
			r := benchRelay(b, bucket, srv.URL)
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx, nil) }()
			defer func() { cancel(); <-done }()
			for r.Lease() == nil {
				time.Sleep(time.Millisecond)
			}
			body := bytes.Repeat([]byte("x"), 256)
			batch := make([]sink.Effect, 0, 128)
			b.ResetTimer()
			for i := 0; i < b.N; {
				batch = batch[:0]
				for ; i < b.N && len(batch) < cap(batch); i++ {
					p := leasehold.Partition(i % 16)
					batch = append(batch, sink.Effect{Subject: "bench.out." + p.String(), Data: body,
						Stamp: leasehold.Stamp{Scope: "bench", Partition: p, Epoch: 1, Acquisition: "a1", Key: fmt.Sprintf("bench.%d.%d", p, i), Worker: "w"}})
				}
				if err := r.DeliverBatch(ctx, batch); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
		})
	}
}

// BenchmarkRelayRunSink is the whole path: b.N effects in the effect log
// (16 partitions, 256-byte bodies) delivered by a relay that holds its
// lock and runs the stream sink runner, until the runner has saved the
// last position. Publishing is not timed.
func BenchmarkRelayRunSink(b *testing.B) {
	srv := okServer(b, false)
	srvNATS := natstest.Start(b)
	js := srvNATS.JetStream(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	bucket, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "bench-leases"})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "bench-effects", Subjects: []string{"bench.out.>"},
		Storage: jetstream.FileStorage, DenyDelete: true, DenyPurge: true}); err != nil {
		b.Fatal(err)
	}
	body := bytes.Repeat([]byte("x"), 256)
	var last uint64
	for p := range leasehold.Partition(16) {
		h := nats.Header{}
		leasehold.Stamp{Scope: "bench", Partition: p, Epoch: 1, Acquisition: "a1", Key: leasehold.BarrierKey("bench", p, 1), Worker: "w"}.SetHeader(h)
		h.Set(leasehold.HeaderBarrier, "1")
		if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: "bench.out.barrier", Header: h}); err != nil {
			b.Fatal(err)
		}
	}
	var futs []jetstream.PubAckFuture
	for i := range b.N {
		p := leasehold.Partition(i % 16)
		h := nats.Header{}
		leasehold.Stamp{Scope: "bench", Partition: p, Epoch: 1, Acquisition: "a1", Key: fmt.Sprintf("bench.%d.%d", p, i), Worker: "w"}.SetHeader(h)
		f, err := js.PublishMsgAsync(&nats.Msg{Subject: "bench.out." + p.String(), Header: h, Data: body})
		if err != nil {
			b.Fatal(err)
		}
		futs = append(futs, f)
	}
	for _, f := range futs {
		select {
		case a := <-f.Ok():
			last = max(last, a.Sequence)
		case err := <-f.Err():
			b.Fatal(err)
		}
	}
	r := benchRelay(b, bucket, srv.URL)
	b.ResetTimer()
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- r.RunSink(rctx, js, streamsink.Config{Prefix: "bench", Consumer: "bench-relay", Name: "relay", Logger: quiet()})
	}()
	rr := &relay{Relay: r, cancel: stop, done: done}
	rr.waitPosition(b, last)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
	_ = rr.stop()
}
