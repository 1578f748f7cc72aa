package bench

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/retry"
)

// filterResult is one consumer layout on raw JetStream.
type filterResult struct {
	create   float64 // s to create every consumer
	cpuMsPS  float64 // this process's CPU per second, idle
	msgsPS   float64 // server messages per second, idle
	drainPS  float64 // messages per second from the first publish of a backlog until every one is delivered
	backlogN int
}

// multiFilter compares two ways to read P partitions from W workers, on
// raw JetStream with nothing of leasehold: a consumer per partition, each
// with one filter subject (what a worker does for every partition it
// holds), and a consumer per worker whose FilterSubjects are its P/W
// partitions' subjects. Each consumer has a pull request always waiting,
// renewed as it expires, as the worker's fetcher keeps one. The server
// matches a multi-filter consumer's filters against the stream's subjects
// to find its next message: the drain row measures what that costs while a
// backlog spread over every partition is delivered. (What a consumer
// costs in memory is in the partition rows: the heap of a server that has
// just dropped another layout's stream is too unsettled to tell.)
func (e *env) multiFilter(ctx context.Context) ([]Row, error) {
	counts, window, backlog, runs := []int{256, 1024, 4096}, 10*time.Second, 100_000, min(e.cfg.Runs, 2)
	if e.cfg.Quick {
		counts, window, backlog, runs = []int{64}, 2*time.Second, 10_000, 1
	}
	var rows []Row
	for _, p := range counts {
		var one, multi [4][]float64
		for run := range runs {
			order := []bool{false, true}
			if run%2 == 1 {
				order = []bool{true, false}
			}
			for _, m := range order {
				r, err := e.consumerLayout(ctx, fmt.Sprintf("mf%d-%d-%v", p, run, m), p, m, backlog, window)
				if err != nil {
					return rows, fmt.Errorf("%d partitions, multi-filter %v: %w", p, m, err)
				}
				out := &one
				if m {
					out = &multi
				}
				for i, v := range []float64{r.create, r.cpuMsPS, r.msgsPS, r.drainPS} {
					out[i] = append(out[i], v)
				}
				e.progress("filters %d partitions over %d workers, multi-filter %v, run %d: created in %.2f s, idle %.2f ms CPU/s and %.0f msgs/s, backlog of %d drained at %.0f msgs/s",
					p, partitionWorkers, m, run+1, r.create, r.cpuMsPS, r.msgsPS, r.backlogN, r.drainPS)
			}
		}
		what := fmt.Sprintf("raw JetStream, %d partitions read from %d connections, a pull request always waiting on each consumer; value: a consumer per partition (one filter each); baseline: a consumer per connection filtering on its %d partitions' subjects", p, partitionWorkers, p/partitionWorkers)
		name := fmt.Sprintf("partitions_filters_%d", p)
		rows = append(rows,
			paired(name+"_create", "s", one[0], multi[0], what+": time to create every consumer"),
			paired(name+"_idle_cpu", "ms CPU/s", one[1], multi[1], what+fmt.Sprintf(": CPU of this process (server and pullers) per second while idle, over %v", window)),
			paired(name+"_idle_msgs", "msgs/s", one[2], multi[2], what+": messages into and out of the server per second while idle"),
			paired(name+"_drain", "msgs/s", one[3], multi[3], what+fmt.Sprintf(": %d messages of 64 B spread over every partition, published while the consumers wait, from the first publish until every one is delivered", backlog)),
		)
	}
	return rows, nil
}

func (e *env) consumerLayout(ctx context.Context, prefix string, partitions int, multi bool, backlog int, window time.Duration) (filterResult, error) {
	res := filterResult{backlogN: backlog}
	nc, js, err := e.connect("bench filters " + prefix)
	if err != nil {
		return res, err
	}
	defer e.release(nc)
	stream := prefix + "-jobs"
	_, err = retry.Value(ctx, func(ctx context.Context) (jetstream.Stream, error) {
		return js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ".jobs.*"}, Storage: jetstream.FileStorage,
			Replicas: e.replicas(), MaxConsumers: -1})
	})
	if err != nil {
		return res, err
	}
	defer e.dropStreams(ctx, js, prefix+"-")
	subject := func(p int) string { return prefix + ".jobs." + strconv.Itoa(p) }

	pctx, stop := context.WithCancel(ctx)
	var pullers sync.WaitGroup
	var conns []*nats.Conn
	defer func() {
		stop()
		pullers.Wait()
		for _, c := range conns {
			e.release(c)
		}
	}()
	var got, ready atomic.Int64
	t0 := time.Now()
	var names []struct {
		nc   *nats.Conn
		name string
	}
	var mu sync.Mutex
	var errs []error
	var creating sync.WaitGroup
	for w := range partitionWorkers {
		wnc, wjs, err := e.connect(fmt.Sprintf("bench filters %s-%d", prefix, w))
		if err != nil {
			return res, err
		}
		conns = append(conns, wnc)
		var mine []string
		for p := w; p < partitions; p += partitionWorkers {
			mine = append(mine, subject(p))
		}
		creating.Go(func() {
			cfgs := []jetstream.ConsumerConfig{}
			base := jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy, MemoryStorage: true, Replicas: 1, InactiveThreshold: time.Minute}
			if multi {
				c := base
				c.FilterSubjects = mine
				cfgs = append(cfgs, c)
			} else {
				for _, s := range mine {
					c := base
					c.FilterSubject = s
					cfgs = append(cfgs, c)
				}
			}
			for _, c := range cfgs {
				cons, err := retry.Value(ctx, func(ctx context.Context) (jetstream.Consumer, error) { return wjs.CreateConsumer(ctx, stream, c) })
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					names = append(names, struct {
						nc   *nats.Conn
						name string
					}{wnc, cons.CachedInfo().Name})
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		})
	}
	creating.Wait()
	if len(errs) > 0 {
		return res, fmt.Errorf("create consumers: %w", errs[0])
	}
	res.create = time.Since(t0).Seconds()
	for _, n := range names {
		pullers.Go(func() { rawPull(pctx, n.nc, "$JS.API.CONSUMER.MSG.NEXT."+stream+"."+n.name, &got, &ready) })
	}
	if err := wait(ctx, time.Minute, "every consumer has a pull request waiting", func() bool { return ready.Load() == int64(len(names)) }); err != nil {
		return res, err
	}
	// The first heartbeats come a second after the requests.
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(2 * time.Second):
	}
	if res.cpuMsPS, res.msgsPS, err = e.idleLoad(ctx, window); err != nil {
		return res, err
	}

	data := make([]byte, 64)
	t1 := time.Now()
	for i := range backlog {
		if _, err := js.PublishAsync(subject(i%partitions), data); err != nil {
			return res, err
		}
		if (i+1)%1000 == 0 || i == backlog-1 {
			select {
			case <-js.PublishAsyncComplete():
			case <-ctx.Done():
				return res, ctx.Err()
			}
		}
	}
	if err := wait(ctx, 2*time.Minute, "every message of the backlog delivered", func() bool { return got.Load() >= int64(backlog) }); err != nil {
		return res, fmt.Errorf("%w (%d delivered)", err, got.Load())
	}
	res.drainPS = float64(backlog) / time.Since(t1).Seconds()
	return res, nil
}

// rawPull keeps a pull request of 100 messages waiting on a consumer, as
// the worker's fetcher does: one subscription, the next request sent when
// the last one is filled or expires, counting what arrives.
func rawPull(ctx context.Context, nc *nats.Conn, subject string, got, ready *atomic.Int64) {
	const batch = 100
	msgs := make(chan *nats.Msg, batch+16)
	sub, err := nc.ChanSubscribe(nc.NewInbox(), msgs)
	if err != nil {
		return
	}
	defer func() { _ = sub.Unsubscribe() }()
	body := []byte(fmt.Sprintf(`{"batch":%d,"expires":%d,"idle_heartbeat":%d}`, batch, 5*time.Second, time.Second))
	quiet := 3 * time.Second
	timer := time.NewTimer(quiet)
	defer timer.Stop()
	for first := true; ctx.Err() == nil; first = false {
		if nc.PublishRequest(subject, sub.Subject, body) != nil {
			return
		}
		if first {
			ready.Add(1)
		}
		timer.Reset(quiet)
	request:
		for n := 0; n < batch; {
			select {
			case m := <-msgs:
				timer.Reset(quiet)
				if m.Header.Get("Status") != "" && len(m.Data) == 0 && m.Reply == "" {
					if m.Header.Get("Status") == "100" {
						continue
					}
					break request // expired, or refused: send the next
				}
				n++
				got.Add(1)
			case <-timer.C:
				break request
			case <-ctx.Done():
				return
			}
		}
	}
}
