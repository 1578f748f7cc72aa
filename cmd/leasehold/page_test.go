package main

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/fleet"
	"github.com/leasehold/leasehold/internal/headless"
	"github.com/leasehold/leasehold/statuspage"
	"github.com/leasehold/leasehold/worker"
)

// waitHTTP waits until url answers 200 and returns the body.
func waitHTTP(t *testing.T, ctx context.Context, url string) string {
	t.Helper()
	for {
		code, body := httpGet(url)
		if code == 200 {
			return body
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s never answered 200: %d %s", url, code, body)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// The status page in a real headless Chromium, during a run like the
// demo's: two worker processes with write-behind handlers, a KV sink and
// `leasehold status --http`. The page is loaded before anything goes
// wrong; then the worker holding the most partitions is frozen past its
// TTL in the middle of a job and resumed, so that it writes with an epoch
// it no longer holds. The page must show, without being reloaded, the
// take-over of its partitions and the sink's refusal of its write (who,
// which epoch, against which), pushed by server-sent events; and a forged
// event carrying markup must show as text.
func TestStatusPageInChromium(t *testing.T) {
	t.Parallel()
	defer oneFleet(t)()
	if testing.Short() {
		t.Skip("runs worker processes and a browser")
	}
	headless.Path(t) // skip early, before starting anything
	s, ctx := listening(t, 4*time.Minute)
	const partitions = 4
	mustRun(t, ctx, "init", "--nats", s.URL(), "--partitions", fmt.Sprint(partitions))
	sinkAddr, statusAddr := freeAddr(t), freeAddr(t)
	background(t, "sink", "--nats", s.URL(), "--name", "kv", "--http", sinkAddr, "--log-level", "error")
	background(t, "status", "--nats", s.URL(), "--http", statusAddr)

	dir := t.TempDir()
	hist := filepath.Join(dir, "history")
	procs := map[string]*fleet.Proc{}
	for _, name := range []string{"worker-1", "worker-2"} {
		p, err := fleet.Start(name, []string{"worker", "--nats", s.URL(), "--partitions", fmt.Sprint(partitions),
			"--worker-id", name, "--ttl", "2s", "--work-time", "150ms", "--write-behind",
			"--http", "", "--log-level", "error", "--history", hist}, fleet.Options{LogDir: filepath.Join(dir, "logs")})
		if err != nil {
			t.Fatal(err)
		}
		procs[name] = p
		t.Cleanup(func() { _ = p.Resume(); _ = p.Stop(30 * time.Second) })
	}
	js := s.JetStream(t)
	producer, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "leasehold", Partitions: partitions})
	if err != nil {
		t.Fatal(err)
	}
	pctx, stopProducing := context.WithCancel(ctx)
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		for i := 0; pctx.Err() == nil; i++ {
			_, _ = producer.Enqueue(pctx, []byte(fmt.Sprint("order-", i)), []byte(fmt.Sprintf(`{"order":%d}`, i)))
			select {
			case <-pctx.Done():
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	defer func() { stopProducing(); <-produced }()

	bucket, err := coordinator.OpenBucket(ctx, js, "")
	if err != nil {
		t.Fatal(err)
	}
	// Both workers hold partitions before the page loads.
	for {
		st, err := bucket.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held := map[string]int{}
		for _, p := range st.Partitions {
			held[p.Holder]++
		}
		if held["worker-1"] > 0 && held["worker-2"] > 0 {
			break
		}
		if err := sleepCtx(ctx, 100*time.Millisecond); err != nil {
			t.Fatalf("the workers never shared the partitions: %v", st.Partitions)
		}
	}

	page := "http://" + statusAddr + "/"
	waitHTTP(t, ctx, page)
	browser := headless.Start(t, ctx, page)
	browser.WaitFor(t, ctx, "the first state", `Number(document.body.dataset.updates) >= 1 && document.getElementById("partitions").rows.length === `+fmt.Sprint(partitions))
	// The table: each partition held by one of the workers, at an epoch
	// shown by its last digits (whole in its title), renewed with its
	// holder's session a moment ago, with its lag read.
	browser.WaitFor(t, ctx, "holders, epochs, renewals and lag", `Array.from(document.querySelectorAll("#partitions tr")).every(tr => {
		const c = tr.cells; return c.length === 8 && /^worker-[12]$/.test(c[1].textContent) && /^…[0-9]{6}$/.test(c[2].textContent) && /^[0-9]{16}$/.test(c[2].title) &&
			c[2].title.endsWith(c[2].textContent.slice(1)) && /^[0-9.]+m?s ago \(session\)$/.test(c[4].textContent) && /^[0-9]+$/.test(c[7].textContent)
	})`)
	var refusedBefore string
	if err := browser.Eval(ctx, `document.getElementById("refusals").innerText`, &refusedBefore); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(refusedBefore, "worker-") {
		t.Fatalf("refusals before any freeze: %q", refusedBefore)
	}
	// A mark that a reload would wipe out.
	var ok bool
	if err := browser.Eval(ctx, `window.loadedOnce = "yes"; true`, &ok); err != nil {
		t.Fatal(err)
	}

	// The freeze, as the demo does it: the worker holding the most
	// partitions, paused in the middle of a job for TTL + 2s.
	zombie, held := freezeMidJob(t, ctx, bucket, procs, hist, 4*time.Second)
	t.Logf("froze %s holding partitions %v", zombie, held)

	// Its refusal: the zombie's name in the writer column of a row whose
	// epoch is below the one it was judged against.
	browser.WaitFor(t, ctx, "the frozen worker's refused write", fmt.Sprintf(`Array.from(document.querySelectorAll("#refusals tr.refused")).some(tr => {
		const c = tr.cells; return c.length === 10 && c[1].textContent === %q && BigInt(c[4].dataset.epoch) < BigInt(c[5].dataset.epoch) && c[7].textContent === "stale"
	})`, zombie))
	browser.WaitFor(t, ctx, "the take-over of the frozen worker's partitions", fmt.Sprintf(`Array.from(document.querySelectorAll("#moves tr")).some(tr => {
		const c = tr.cells; return c.length === 8 && c[1].textContent === "take-over" && c[4].textContent === %q && c[6].textContent !== %q
	})`, zombie, zombie))
	var loaded string
	if err := browser.Eval(ctx, `window.loadedOnce || "reloaded"`, &loaded); err != nil || loaded != "yes" {
		t.Fatalf("the page was reloaded (%q, %v): the refusal must arrive by server-sent events", loaded, err)
	}

	// A forged event, as anyone allowed to publish there could write it:
	// its markup must show as text, and an event of the wrong shape not
	// at all.
	forged := `<img src=x id=forged onerror="document.title='owned'">`
	ev, _ := json.Marshal(statuspage.Event{Kind: statuspage.KindRefused, Time: time.Now(), Source: "forger", Scope: "leasehold",
		Worker: forged, Epoch: 1, Max: 2, Outcome: "stale"})
	if _, err := js.Publish(ctx, statuspage.EventSubject("leasehold", statuspage.KindRefused), ev); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, statuspage.EventSubject("leasehold", statuspage.KindRefused), []byte(`{"kind":"bogus"}`)); err != nil {
		t.Fatal(err)
	}
	browser.WaitFor(t, ctx, "the forged event as text", fmt.Sprintf(`Array.from(document.querySelectorAll("#refusals td")).some(td => td.textContent === %q) && document.getElementById("invalid").textContent.startsWith("1 event ")`, forged))
	var injected bool
	if err := browser.Eval(ctx, `document.getElementById("forged") !== null || document.title === "owned"`, &injected); err != nil || injected {
		t.Fatalf("the forged event's markup became part of the page (%v, %v)", injected, err)
	}

	// The sink's own HTTP server serves the page and its state too.
	body := waitHTTP(t, ctx, "http://"+sinkAddr+"/status.json")
	var st statuspage.State
	if err := json.Unmarshal([]byte(body), &st); err != nil || st.ServedBy != "sink kv" {
		t.Errorf("the sink's /status.json: %v, served by %q", err, st.ServedBy)
	}
	if html := waitHTTP(t, ctx, "http://"+sinkAddr+"/"); !strings.Contains(html, "status.js") {
		t.Errorf("the sink's / is not the page: %.200s", html)
	}
}

// freezeMidJob pauses the worker holding the most partitions while one of
// its handlers has taken its stamp and not yet written, keeps it paused for
// pause, resumes it and returns its name and the partitions it held.
func freezeMidJob(t *testing.T, ctx context.Context, b *coordinator.Bucket, procs map[string]*fleet.Proc, hist string, pause time.Duration) (string, []leasehold.Partition) {
	t.Helper()
	for try := 0; ; try++ {
		st, err := b.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		victim := mostPartitions(st, procs)
		if err := procs[victim].Pause(); err != nil {
			t.Fatal(err)
		}
		if try >= 200 || midJob(filepath.Join(hist, victim+".jsonl")) {
			var held []leasehold.Partition
			for _, p := range st.Partitions {
				if p.Holder == victim {
					held = append(held, p.Partition)
				}
			}
			if err := sleepCtx(ctx, pause); err != nil {
				t.Fatal(err)
			}
			if err := procs[victim].Resume(); err != nil {
				t.Fatal(err)
			}
			return victim, held
		}
		if err := procs[victim].Resume(); err != nil {
			t.Fatal(err)
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
}
