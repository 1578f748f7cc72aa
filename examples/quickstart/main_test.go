package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/worker"
	"github.com/leasehold/leasehold/worker/workertest"
)

// The README's first program is this one, word for word.
func TestREADMEShowsThisProgram(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	program, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "\n## A first program\n")
	if !ok {
		t.Fatal(`the README has no section "## A first program"`)
	}
	m := regexp.MustCompile("(?s)```go\n(.*?)```\n").FindStringSubmatch(section)
	if m == nil {
		t.Fatal("the README's first program has no Go block")
	}
	if m[1] != string(program) {
		t.Fatalf("the README's first Go block under \"## A first program\" is not examples/quickstart/main.go: copy the file into the README\nREADME:\n%s", m[1])
	}
	if n := strings.Count(string(program), "\n"); n >= 85 {
		t.Fatalf("the program has %d lines; keep it under 85", n)
	}
}

// The program runs to the end on an embedded server: every job done, the
// sink holding a stamped value.
func TestQuickstartRuns(t *testing.T) {
	t.Setenv("NATS_URL", "")
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	out := make(chan string)
	go func() {
		var b bytes.Buffer
		_, _ = io.Copy(&b, r)
		out <- b.String()
	}()
	func() {
		defer func() { os.Stdout = stdout }()
		main()
	}()
	w.Close()
	text := <-out
	t.Log("\n" + text)
	if n := strings.Count(text, ": done\n"); n != 6 {
		t.Errorf("%d of 6 jobs done", n)
	}
	if !regexp.MustCompile(`sink: invoice\.2 = 200 \(partition \d, epoch \d+\)`).MatchString(text) {
		t.Error("the sink does not hold invoice.2")
	}
}

// A handler tested without NATS: the program's invoice handler, writing to
// a sink kept in memory, runs as a worker holding the partition at epoch 3
// would run it, and its write carries that lease's stamp and the job's
// first idempotency key.
func TestInvoiceHandlerWithoutNATS(t *testing.T) {
	kv := sink.NewMemory(sink.MemoryConfig{KeepLog: true})
	mux := worker.NewMux()
	worker.Handle(mux, "invoice", func(ctx context.Context, j *worker.Job, in Invoice) error {
		return j.Apply(ctx, kv, "invoice."+strconv.Itoa(in.Number), []byte(strconv.Itoa(in.Cents)))
	})
	h := workertest.New(t, workertest.Config{Handler: mux, Worker: worker.Config{Prefix: "shop", Partitions: 4},
		Lease: leasehold.Lease{Epoch: 3, Acquisition: "a1", Holder: "w1"}})
	res := workertest.Work(t.Context(), h, "invoice", Invoice{Number: 2, Cents: 200})
	res.RequireDone()
	applied := kv.Applied()
	if len(applied) != 1 || applied[0].Subject != "invoice.2" || string(applied[0].Data) != "200" {
		t.Fatalf("the sink holds %+v", applied)
	}
	if got, want := applied[0].Stamp, h.Lease(res.Partition).Stamp(res.Key(0)); got != want {
		t.Errorf("stamped %+v, want %+v", got, want)
	}
	// A job of a kind the mux does not serve is dead-lettered at once.
	if dl := workertest.Work(t.Context(), h, "refund", Invoice{Number: 3}).RequireDeadLettered(); dl.Attempts != 1 {
		t.Errorf("an unknown kind ran %d attempts", dl.Attempts)
	}
}
