package main

import (
	"encoding/json"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
)

// A worker and a KV sink run as the command line runs them, with
// --partitions left out (read from the job stream): `sink ls` and `sink
// get` show every value with the stamp it was written under, and the
// sink's /metrics counts each effect once. The runner and the KV sink it
// applies into both counted every decision under one sink name, so 30
// effects read 60 accepted.
func TestSinkLsGetAndEffectsCountedOnce(t *testing.T) {
	t.Parallel()
	s, ctx := initialized(t, 90*time.Second, "--partitions", "4")
	// No bucket yet: a reader says so and creates none.
	if _, err := run(t, ctx, "sink", "ls", "--nats", s.URL()); err == nil || !strings.Contains(err.Error(), "no such KV sink bucket") {
		t.Fatalf("sink ls before the sink ran: %v", err)
	}
	if _, err := s.JetStream(t).Stream(ctx, "KV_leasehold-sink"); err == nil {
		t.Fatal("sink ls created the bucket")
	}
	addr := freeAddr(t)
	background(t, "worker", "--nats", s.URL(), "--worker-id", "w1", "--ttl", "2s", "--http", "", "--log-level", "warn")
	background(t, "sink", "--nats", s.URL(), "--kind", "kv", "--name", "kvs", "--http", addr, "--log-level", "warn")
	const jobs = 30
	if out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "-n", strconv.Itoa(jobs)); err != nil || !strings.Contains(out, "enqueued 30 jobs") {
		t.Fatalf("enqueue without --partitions: %v\n%s", err, out)
	}
	var ls struct {
		Values []sinkValue `json:"values"`
		Fences []sinkFence `json:"fences"`
	}
	for {
		out, err := run(t, ctx, "sink", "ls", "--nats", s.URL(), "--json")
		if err == nil {
			ls.Values, ls.Fences = nil, nil
			if err := json.Unmarshal([]byte(out), &ls); err != nil {
				t.Fatalf("sink ls --json: %v\n%s", err, out)
			}
			if len(ls.Values) == jobs {
				break
			}
		}
		if ctx.Err() != nil {
			t.Fatalf("sink ls never showed %d values: %v\n%s", jobs, err, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	out, err := run(t, ctx, "status", "--nats", s.URL(), "--json")
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	var st coordinator.Status
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatal(err)
	}
	epochs := map[uint32]uint64{}
	for _, p := range st.Partitions {
		epochs[uint32(p.Partition)] = uint64(p.Epoch)
	}
	for _, v := range ls.Values {
		if v.Scope != "leasehold" || v.Worker != "w1" || v.Acquisition == "" || v.StampKey != v.Key || v.Epoch == 0 || v.Epoch != epochs[v.Partition] {
			t.Errorf("value %+v: want scope leasehold, worker w1, an acquisition, its key, epoch %d of partition %d", v, epochs[v.Partition], v.Partition)
		}
	}
	if len(ls.Fences) == 0 {
		t.Errorf("sink ls shows no fences: %+v", ls)
	}
	for _, f := range ls.Fences {
		if f.Scope != "leasehold" || f.Epoch != epochs[f.Partition] {
			t.Errorf("fence %+v: want epoch %d", f, epochs[f.Partition])
		}
	}

	want := ls.Values[0]
	out, err = run(t, ctx, "sink", "get", want.Key, "--nats", s.URL(), "--json")
	if err != nil {
		t.Fatalf("sink get: %v\n%s", err, out)
	}
	var got sinkValue
	if err := json.Unmarshal([]byte(out), &got); err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("sink get %s --json: %+v, want %+v (%v)", want.Key, got, want, err)
	}
	out, err = run(t, ctx, "sink", "get", want.Key, "--nats", s.URL())
	for _, line := range []string{"scope", "partition", "epoch", "acquisition", "worker"} {
		if err != nil || !strings.Contains(out, line+" ") {
			t.Fatalf("sink get %s: no %s line: %v\n%s", want.Key, line, err, out)
		}
	}
	if !strings.Contains(out, strconv.FormatUint(want.Epoch, 10)) || !strings.Contains(out, want.Acquisition) {
		t.Fatalf("sink get %s shows another stamp than %+v:\n%s", want.Key, want, out)
	}
	if _, err := run(t, ctx, "sink", "get", "no-such-key", "--nats", s.URL()); err == nil || !strings.Contains(err.Error(), "holds no value") {
		t.Fatalf("sink get of a missing key: %v", err)
	}
	out, err = run(t, ctx, "sink", "ls", "--nats", s.URL())
	if err != nil || !strings.Contains(out, "EPOCH") || !strings.Contains(out, want.Key) || !strings.Contains(out, "30 values") {
		t.Fatalf("sink ls: %v\n%s", err, out)
	}

	// Every effect is applied: the accepted count is the number of effects.
	code, body := httpGet("http://" + addr + "/metrics")
	if code != 200 {
		t.Fatalf("sink /metrics: %d %s", code, body)
	}
	if n := sumMetric(body, "leasehold_sink_effects_total", `outcome="accepted"`); n != jobs {
		t.Fatalf("leasehold_sink_effects_total{outcome=accepted} is %v for %d effects:\n%s", n, jobs, grepLines(body, "leasehold_sink_effects_total"))
	}
}

// sumMetric adds the samples of the metric whose labels contain label.
func sumMetric(body, name, label string) float64 {
	var sum float64
	for _, l := range strings.Split(body, "\n") {
		if !strings.HasPrefix(l, name+"{") || !strings.Contains(l, label) {
			continue
		}
		f := strings.Fields(l)
		if v, err := strconv.ParseFloat(f[len(f)-1], 64); err == nil {
			sum += v
		}
	}
	return sum
}
