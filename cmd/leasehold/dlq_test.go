package main

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// startDLQWorker runs a worker on the job stream of prefix whose handler
// fails while failing is set (with MaxAttempts 1, so a failed job is
// dead-lettered at once) and hands every job it finishes to the returned
// channel.
func startDLQWorker(t *testing.T, ctx context.Context, js jetstream.JetStream, prefix string, failing *atomic.Bool) (<-chan *worker.Job, *progress) {
	t.Helper()
	done := make(chan *worker.Job, 16)
	prog := runDLQWorker(t, ctx, js, prefix, 2, func(ctx context.Context, j *worker.Job) error {
		if failing.Load() {
			return errors.New("the payment service said no\ntry later")
		}
		done <- j
		return nil
	})
	return done, prog
}

// A job that fails is dead-lettered by a real worker; list and show
// describe it, replay runs it again with its data and its own headers, and
// purge deletes only with --yes given on the command line.
func TestDlqWorkerListShowReplayPurge(t *testing.T) {
	s, ctx := initialized(t, 90*time.Second, "--prefix", "dq", "--partitions", "2")
	js := s.JetStream(t)
	var failing atomic.Bool
	failing.Store(true)
	done, prog := startDLQWorker(t, ctx, js, "dq", &failing)
	p, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "dq", Partitions: 2})
	if err != nil {
		t.Fatal(err)
	}
	enqueue := func(data, id string, opts ...worker.EnqueueOption) {
		t.Helper()
		e, err := p.EnqueueTo(ctx, 1, []byte(data), append(opts, worker.JobID(id), worker.WithHeader(nats.Header{"X-Order": {id}}))...)
		if err != nil {
			t.Fatal(err)
		}
		prog.wait(t, ctx, 1, e.Seq)
	}
	conn := []string{"--nats", s.URL(), "--prefix", "dq"}
	cli := func(args ...string) []string { return append(append([]string{"dlq"}, args...), conn...) }

	enqueue(`{"order":17}`, "order-17", worker.WithKind("refund"))
	out := mustRun(t, ctx, cli("list")...)
	t.Logf("dlq list:\n%s", out)
	wantIn(t, "list", out, "SEQ", "order-17", "the payment service said no | try later", "1 shown; dq-dlq holds 1 dead letters")
	if line := strings.Split(out, "\n")[1]; !strings.HasPrefix(line, "1 ") || !strings.Contains(line, " 12 ") {
		t.Errorf("list line %q: want sequence 1 and 12 bytes", line)
	}
	// The kind says which handler failed it.
	if head, line := strings.Fields(strings.Split(out, "\n")[0]), strings.Fields(strings.Split(out, "\n")[1]); len(head) < 5 || head[4] != "KIND" || len(line) < 5 || line[4] != "refund" {
		t.Errorf("list: want a KIND column showing refund:\n%s", out)
	}
	out = mustRun(t, ctx, cli("show", "1")...)
	t.Logf("dlq show 1:\n%s", out)
	wantIn(t, "show", out, "dead letter 1 of dq-dlq", "subject: dq.dlq.1", "replay:  to dq.jobs.1 (stream dq-jobs)",
		"X-Order: order-17", "Leasehold-Attempts: 1", "Leasehold-Job-Id: order-17", "payload (12 bytes, text):\n{\"order\":17}\n")

	failing.Store(false)
	out = mustRun(t, ctx, cli("replay", "1")...)
	t.Logf("dlq replay 1:\n%s", out)
	wantIn(t, "replay", out, "replayed 1 to dq.jobs.1 (dq-jobs sequence 2); dead letter deleted", "1 replayed")
	select {
	case j := <-done:
		if string(j.Data) != `{"order":17}` || j.Partition != 1 || j.Header.Get("X-Order") != "order-17" {
			t.Errorf("replayed job: partition %d, data %q, headers %v", j.Partition, j.Data, j.Header)
		}
		// It keeps its identity and says what it replays; nothing else
		// of the dead letter's leasehold headers comes back.
		want := map[string]string{
			leasehold.HeaderOrigin:       "dq/1/1",
			leasehold.HeaderReplayOf:     "dq-dlq/1",
			leasehold.HeaderReplayReason: "the payment service said no | try later",
			worker.HeaderKind:            "refund", // which handler runs it
		}
		for k := range j.Header {
			if v, ok := want[k]; ok {
				if j.Header.Get(k) != v {
					t.Errorf("the replayed job's %s is %q, want %q", k, j.Header.Get(k), v)
				}
				continue
			}
			if strings.HasPrefix(k, "Leasehold-") {
				t.Errorf("the replayed job carries the dead letter's %s header", k)
			}
		}
		if o := j.Origin(); o != leasehold.OriginOf("dq", 1, 1) {
			t.Errorf("the replayed job's origin is %s, want dq/1/1", o)
		}
	case <-ctx.Done():
		t.Fatal("the replayed job never ran")
	}
	wantIn(t, "list after replay", mustRun(t, ctx, cli("list")...), "no dead letters in dq-dlq")
	if out, err := run(t, ctx, cli("replay", "1")...); err == nil || !strings.Contains(err.Error(), "no dead letter at sequence 1") {
		t.Errorf("second replay: %v\n%s", err, out)
	}

	// The replay left its record at sequence 2: no dead letter.
	if out, err := run(t, ctx, cli("show", "2")...); err == nil || !strings.Contains(err.Error(), "no dead letter but a record") {
		t.Errorf("show of the replay's record: %v\n%s", err, out)
	}

	failing.Store(true)
	enqueue("two", "order-2")
	enqueue("three", "order-3")
	out, err = run(t, ctx, cli("purge", "3")...)
	t.Logf("dlq purge 3: %v\n%s", err, out)
	if err == nil || !strings.Contains(err.Error(), "nothing deleted") || !strings.Contains(out, "order-2") {
		t.Fatalf("purge without --yes: %v\n%s", err, out)
	}
	// A --yes from the environment does not count.
	t.Setenv("LEASEHOLD_YES", "true")
	if _, err := run(t, ctx, cli("purge", "--all")...); err == nil {
		t.Fatal("purge --all took --yes from the environment")
	}
	wantIn(t, "list after refused purges", mustRun(t, ctx, cli("list", "--limit", "1")...), "order-2", "dq-dlq holds 2 dead letters", "more follow: add --from 4")
	wantIn(t, "purge 3 --yes", mustRun(t, ctx, cli("purge", "3", "--yes")...), "deleted 1 dead letters")
	wantIn(t, "purge --all --yes", mustRun(t, ctx, cli("purge", "--all", "--yes")...), "order-3", "deleted 1 dead letters from dq-dlq")
	wantIn(t, "list after purges", mustRun(t, ctx, cli("list")...), "no dead letters in dq-dlq")
}

// A sink dead letter, published as the stream sink does, lists and shows
// with its binary payload, replays onto the effect log subject it came
// from with its stamp (and not the dead-letter headers), and purges; one
// without a subject, or whose subject is not the effect log's, is refused
// and kept.
func TestDlqSinkListShowReplayPurge(t *testing.T) {
	s, ctx := initialized(t, 90*time.Second, "--prefix", "sq", "--partitions", "4")
	js := s.JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "sq-sink-dlq", Subjects: []string{"sq.sinkdlq.>"}, Storage: jetstream.FileStorage, Duplicates: 10 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	stamp := leasehold.Stamp{Scope: "sq", Partition: 3, Epoch: 9, Acquisition: "a9", Key: "sq.3.40.0", Worker: "w1"}
	data := []byte{0, 1, 2, 0xff, 'x'}
	n := 0
	publish := func(subject string) {
		t.Helper()
		n++
		msg := nats.NewMsg("sq.sinkdlq.sink")
		msg.Data = data
		stamp.SetHeader(msg.Header)
		msg.Header.Set("Traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
		msg.Header.Set("Nats-Msg-Id", "sink.sq.3.40.0~"+strconv.Itoa(n))
		msg.Header.Set("Leasehold-Sink-Error", "downstream: nats: no responders available for request")
		msg.Header.Set("Leasehold-Sink-Tries", "10")
		msg.Header.Set("Leasehold-Sink-Seq", "40")
		msg.Header.Set("Leasehold-Sink-Log", "sq-effects")
		msg.Header.Set("Leasehold-Sink-Name", "sink")
		if subject != "" {
			msg.Header.Set("Leasehold-Sink-Subject", subject)
		}
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	publish("sq.out.3")
	conn := []string{"--nats", s.URL(), "--prefix", "sq", "--sink"}
	cli := func(args ...string) []string { return append(append([]string{"dlq"}, args...), conn...) }

	out := mustRun(t, ctx, cli("list")...)
	t.Logf("dlq list --sink:\n%s", out)
	wantIn(t, "list", out, "KEY", "TRIES", "sq.3.40.0", " 10 ", "downstream: nats: no responders", "sq-sink-dlq holds 1")
	out = mustRun(t, ctx, cli("show", "1")...)
	t.Logf("dlq show 1 --sink:\n%s", out)
	wantIn(t, "show", out, "replay:  to sq.out.3 (stream sq-effects)", "Leasehold-Sink-Tries: 10", "Leasehold-Epoch: 9",
		"payload (5 bytes, not printable text: base64 follows", "AAEC/3g=")
	if out := mustRun(t, ctx, cli("show", "1", "--raw")...); out != string(data) {
		t.Errorf("show --raw wrote %q, want %q", out, data)
	}

	out = mustRun(t, ctx, cli("replay", "1")...)
	t.Logf("dlq replay 1 --sink:\n%s", out)
	wantIn(t, "replay", out, "replayed 1 to sq.out.3 (sq-effects sequence 1)")
	effects, err := js.Stream(ctx, "sq-effects")
	if err != nil {
		t.Fatal(err)
	}
	m, err := effects.GetLastMsgForSubject(ctx, "sq.out.3")
	if err != nil {
		t.Fatal(err)
	}
	got, err := leasehold.StampFromHeader(m.Header)
	if err != nil || got != stamp || !bytes.Equal(m.Data, data) || m.Header.Get("Traceparent") == "" {
		t.Errorf("replayed effect: stamp %+v (%v), data %q, headers %v", got, err, m.Data, m.Header)
	}
	if id := m.Header.Get("Nats-Msg-Id"); strings.HasPrefix(id, "sink.") || !strings.HasSuffix(id, ".replay") {
		t.Errorf("replayed effect has message ID %q, want the replay's own", id)
	}
	for k := range m.Header {
		if strings.HasPrefix(k, "Leasehold-Sink-") {
			t.Errorf("the replayed effect carries the dead letter's %s header", k)
		}
	}

	publish("")          // 2: no subject
	publish("sq.jobs.0") // 3: the job stream's, not the effect log's
	publish("elsewhere") // 4: no stream's
	publish("sq.out.*")  // 5: not one subject
	for seq, want := range map[string]string{
		"2": "no Leasehold-Sink-Subject header",
		"3": "stored by sq-jobs, not by the effect log sq-effects",
		"4": "no stream stores its subject elsewhere",
		"5": "not a literal subject",
	} {
		out, err := run(t, ctx, cli("replay", seq)...)
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "it is kept") {
			t.Errorf("replay %s: %v, want %q\n%s", seq, err, want, out)
		}
	}
	if out, err := run(t, ctx, cli("replay", "--all")...); err == nil || !strings.Contains(err.Error(), "dead letter 2 not replayed") {
		t.Errorf("replay --all: %v\n%s", err, out)
	}
	wantIn(t, "list after refused replays", mustRun(t, ctx, cli("list")...), "sq-sink-dlq holds 4 dead letters")
	if out, err := run(t, ctx, cli("purge", "--all")...); err == nil || !strings.Contains(err.Error(), "the 4 dead letters above") {
		t.Errorf("purge --all without --yes: %v\n%s", err, out)
	}
	wantIn(t, "purge --all --yes", mustRun(t, ctx, cli("purge", "--all", "--yes")...), "deleted 4 dead letters from sq-sink-dlq")
	wantIn(t, "list after purge", mustRun(t, ctx, cli("list")...), "no dead letters in sq-sink-dlq")

	// A replay the target stream calls a duplicate is taken for stored
	// only when the stored message is the replay.
	sinkDLQ, err := js.Stream(ctx, "sq-sink-dlq")
	if err != nil {
		t.Fatal(err)
	}
	publish("sq.out.3") // 6: someone else took its replay's message ID
	publish("sq.out.3") // 7: replayed before, but not deleted
	publish("sq.out.3") // 8: someone else took it with the same subject and data
	for seq, forged := range map[uint64]bool{6: true, 7: false, 8: true} {
		dl, err := sinkDLQ.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		first, err := (&dlq{name: "sq-sink-dlq", sink: true}).replayMsg(dl)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case forged && seq == 6:
			first.Subject, first.Data = "sq.out.2", []byte("forged")
		case forged:
			// Only a header differs: the look-alike would run under
			// another stamp while the dead letter went as replayed.
			first.Header.Set("Leasehold-Kind", "other")
		}
		if _, err := js.PublishMsg(ctx, first); err != nil {
			t.Fatal(err)
		}
	}
	for _, seq := range []string{"6", "8"} {
		if out, err := run(t, ctx, cli("replay", seq)...); err == nil || !strings.Contains(err.Error(), "holds another message") {
			t.Errorf("replay %s over a forged message ID: %v\n%s", seq, err, out)
		}
	}
	wantIn(t, "replay of a replayed dead letter", mustRun(t, ctx, cli("replay", "7")...), "stored by an earlier replay); dead letter deleted")
	wantIn(t, "list after the duplicate replays", mustRun(t, ctx, cli("list")...), "sq-sink-dlq holds 2 dead letters")
}

// Headers come from the network: garbage lists and shows as is, quoted
// where it could drive the terminal, and a dead letter naming a subject
// outside the job stream (here the lease bucket's) is never replayed.
func TestDlqUntrustedHeaders(t *testing.T) {
	s, ctx := initialized(t, 60*time.Second, "--prefix", "dz", "--partitions", "1")
	js := s.JetStream(t)
	msg := nats.NewMsg(worker.DLQSubject("dz", 0))
	msg.Data = []byte("hello\x1b[2J")
	msg.Header.Set(worker.HeaderAttempts, "many")
	msg.Header.Set(leasehold.HeaderPartition, "\x1b[31mred")
	msg.Header.Set(worker.HeaderError, strings.Repeat("e", 3000))
	msg.Header.Set(worker.HeaderSubject, "$KV.dz-leases.0")
	msg.Header.Set("X-Bad-UTF8", "\xff\xfe")
	if _, err := js.PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}
	conn := []string{"--nats", s.URL(), "--prefix", "dz"}
	for _, args := range [][]string{{"list"}, {"show", "1"}} {
		out := mustRun(t, ctx, append(append([]string{"dlq"}, args...), conn...)...)
		t.Logf("dlq %v:\n%s", args, out)
		if strings.Contains(out, "\x1b") {
			t.Errorf("dlq %v printed a raw escape:\n%q", args, out)
		}
		wantIn(t, "dlq "+args[0], out, "many", `"\x1b[31mred"`)
	}
	out := mustRun(t, ctx, append([]string{"dlq", "show", "1"}, conn...)...)
	wantIn(t, "show", out, `X-Bad-UTF8: "\xff\xfe"`, "not printable text", "stored by KV_dz-leases")
	if out, err := run(t, ctx, append([]string{"dlq", "replay", "1"}, conn...)...); err == nil || !strings.Contains(err.Error(), "stored by KV_dz-leases, not by the job stream dz-jobs") {
		t.Errorf("replay into the lease bucket: %v\n%s", err, out)
	}
	// Stored by the job stream, but no partition's: no worker would run it.
	for _, subject := range []string{"dz.jobs.1", "dz.jobs.00", "dz.jobs.x"} {
		msg := nats.NewMsg(worker.DLQSubject("dz", 0))
		msg.Header.Set(worker.HeaderSubject, subject)
		ack, err := js.PublishMsg(ctx, msg)
		if err != nil {
			t.Fatal(err)
		}
		seq := strconv.FormatUint(ack.Sequence, 10)
		if out, err := run(t, ctx, append([]string{"dlq", "replay", seq}, conn...)...); err == nil || !strings.Contains(err.Error(), "no partition's of the job stream (dz.jobs.0 to dz.jobs.0)") {
			t.Errorf("replay to %s: %v\n%s", subject, err, out)
		}
	}
	if _, err := run(t, ctx, append([]string{"dlq", "list", "--sink"}, conn...)...); err == nil || !strings.Contains(err.Error(), "dz-sink-dlq does not exist") {
		t.Errorf("list of a missing stream: %v", err)
	}
	if _, err := run(t, ctx, append([]string{"dlq", "show", "x1"}, conn...)...); err == nil {
		t.Error("show x1 was accepted")
	}
}
