package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/freeport"
	"github.com/leasehold/leasehold/worker"
)

// freeAddr is a loopback address for a command to listen on, below the
// kernel's ephemeral ports, so that no outgoing connection takes it
// before the command starts.
func freeAddr(t *testing.T) string {
	t.Helper()
	port, err := freeport.Loopback()
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}

// background runs a command line until the test ends and returns its
// error channel. What the command printed is logged if the test failed.
func background(t *testing.T, args ...string) (context.CancelFunc, <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	finished := make(chan struct{})
	var out string
	go func() {
		defer close(finished)
		var err error
		out, err = run(t, ctx, args...)
		done <- err
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-finished:
			if t.Failed() {
				t.Logf("%v printed:\n%s", args, out)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("%v did not stop", args)
		}
	})
	return cancel, done
}

func httpGet(url string) (int, string) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// init, two workers and a KV sink, run as the command line runs them:
// every job's effect lands in the sink once, and the endpoints answer.
func TestInitWorkerSink(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, 90*time.Second)
	out, err := run(t, ctx, "init", "--nats", s.URL(), "--partitions", "4")
	if err != nil {
		t.Fatalf("init: %v\n%s", err, out)
	}
	if !strings.Contains(out, "leasehold-jobs") || !strings.Contains(out, "sync_interval") {
		t.Fatalf("init output:\n%s", out)
	}
	// Running it again is safe.
	if out, err := run(t, ctx, "init", "--nats", s.URL(), "--partitions", "4"); err != nil {
		t.Fatalf("second init: %v\n%s", err, out)
	}
	// A worker configured with another partition count is refused.
	if out, err := run(t, ctx, "worker", "--nats", s.URL(), "--partitions", "5", "--http", ""); err == nil || !strings.Contains(err.Error(), "partition") {
		t.Fatalf("worker with 5 partitions on a 4-partition stream: %v\n%s", err, out)
	} else {
		t.Log(err)
	}

	addrs := []string{freeAddr(t), freeAddr(t), freeAddr(t)}
	background(t, "worker", "--nats", s.URL(), "--partitions", "4", "--worker-id", "w1", "--ttl", "2s", "--http", addrs[0], "--log-level", "warn")
	background(t, "worker", "--nats", s.URL(), "--partitions", "4", "--worker-id", "w2", "--ttl", "2s", "--http", addrs[1], "--log-level", "warn")
	background(t, "sink", "--nats", s.URL(), "--kind", "kv", "--http", addrs[2], "--log-level", "warn")

	js := s.JetStream(t)
	if out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "--partitions", "4", "-n", "50"); err != nil || !strings.Contains(out, "enqueued 50 jobs") {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "leasehold", Partitions: 4})
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for i := range 200 {
		e, err := p.Enqueue(ctx, []byte(fmt.Sprintf("key-%d", i)), []byte("job"))
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, leasehold.EffectKey("leasehold", e.Partition, e.Seq, 0))
	}
	var kv jetstream.KeyValue
	for kv == nil {
		kv, _ = js.KeyValue(ctx, "leasehold-sink")
		if ctx.Err() != nil {
			t.Fatal("the sink never created its bucket")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, k := range keys {
		for {
			if _, err := kv.Get(ctx, k); err == nil {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("effect %s never reached the sink", k)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	for i, a := range addrs {
		if code, body := httpGet("http://" + a + "/readyz"); code != 200 {
			t.Errorf("process %d /readyz: %d %s", i, code, body)
		}
		if code, body := httpGet("http://" + a + "/livez"); code != 200 {
			t.Errorf("process %d /livez: %d %s", i, code, body)
		}
	}
	if code, body := httpGet("http://" + addrs[0] + "/metrics"); code != 200 || !strings.Contains(body, "leasehold_lease_acquisitions_total") {
		t.Errorf("worker /metrics: %d\n%s", code, grepLines(body, "leasehold_"))
	}
}

func grepLines(body, prefix string) string {
	var out []string
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
