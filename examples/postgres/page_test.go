package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/freeport"
	"github.com/leasehold/leasehold/internal/headless"
	"github.com/leasehold/leasehold/testing/pgtest"
)

// A program of one's own, with its own workers and a PostgreSQL sink,
// gets the status page with one call (statuspage.Serve): in a real
// headless Chromium the page shows worker-a's late transaction refused by
// the sink (the writer, its epoch below the one it was judged against,
// the sink that refused it) and the partition's move to worker-b. The
// screenshot is taken once the page has shown its first
// state, on the page's own event, not after a guessed wait; with
// $LEASEHOLD_SCREENSHOTS set it is kept there.
func TestRefusalOnThePage(t *testing.T) {
	t.Parallel()
	headless.Path(t) // skip early, before starting anything
	dsn := pgtest.Start(t).CreateDatabase(t, "shop")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	viewed := false
	_, err := run(ctx, &out, options{postgres: dsn, http: freeAddr(t), hold: func(ctx context.Context, url string) error {
		viewed = true
		b := headless.Start(t, ctx, url)
		var shown bool
		if err := b.Await(ctx, `new Promise(shown => Number(document.body.dataset.updates) >= 1 ? shown(true)
			: document.addEventListener("leasehold:state", () => shown(true), {once: true}))`, &shown); err != nil {
			return fmt.Errorf("waiting for the page's first state: %w", err)
		}
		png, err := b.Screenshot(ctx)
		if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) {
			return fmt.Errorf("screenshot: %d bytes, %v", len(png), err)
		}
		var partitions int
		if err := b.Eval(ctx, `document.querySelectorAll("#partitions tr:not(.free)").length`, &partitions); err != nil || partitions != 1 {
			return fmt.Errorf("the screenshot was taken with %d held partitions on the page (%v); want the one", partitions, err)
		}
		dir := os.Getenv("LEASEHOLD_SCREENSHOTS")
		if dir == "" {
			dir = t.TempDir()
		}
		if err := os.WriteFile(filepath.Join(dir, "postgres-example-page.png"), png, 0o644); err != nil {
			return err
		}
		b.WaitFor(t, ctx, "worker-a's refused transaction", `Array.from(document.querySelectorAll("#refusals tr.refused")).some(tr => {
			const c = tr.cells; return c.length === 10 && c[1].textContent === "worker-a" && c[2].textContent === "orders" &&
				BigInt(c[4].dataset.epoch) < BigInt(c[5].dataset.epoch) && c[7].textContent === "stale" && c[9].textContent === "shop"
		})`)
		// The page found its events stream (ProvisionJobs made it), and
		// has nothing to complain of.
		var errs string
		if err := b.Eval(ctx, `document.getElementById("errors-section").hidden ? "" : document.getElementById("errors").innerText`, &errs); err != nil || errs != "" {
			return fmt.Errorf("the page shows errors: %q (%v)", errs, err)
		}
		// worker-a's drain gave up on its frozen handler: a move, but no
		// clean hand-off.
		b.WaitFor(t, ctx, "the partition's move to worker-b", `Array.from(document.querySelectorAll("#moves tr")).some(tr => {
			const c = tr.cells; return c.length === 8 && c[1].textContent === "take-over" && c[4].textContent === "worker-a" && c[6].textContent === "worker-b" &&
				BigInt(c[5].dataset.epoch) < BigInt(c[7].dataset.epoch)
		})`)
		return nil
	}})
	if err != nil || !viewed {
		t.Fatalf("run (the page viewed: %v): %v\n%s", viewed, err, out.String())
	}
}

// freeAddr is a loopback address for the example to listen on, below the
// kernel's ephemeral ports, so that no outgoing connection takes it
// before the example starts.
func freeAddr(t *testing.T) string {
	t.Helper()
	port, err := freeport.Loopback()
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}
