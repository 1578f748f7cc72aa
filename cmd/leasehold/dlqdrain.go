package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

func newDLQReplay() *cobra.Command {
	var (
		f   dlqFlags
		all bool
	)
	cmd := &cobra.Command{
		Use:   "replay SEQ... | --all",
		Short: "Send dead letters back where they came from, then delete them",
		Long: `replay publishes each dead letter again where it came from and deletes it once
the server has acknowledged the replay. Fix what made it fail first.

Jobs (the default): the job goes back on its job subject, the Leasehold-Subject
header, which must be stored by <prefix>-jobs. It keeps its payload and its own
headers; the dead-letter headers, the worker's stamp and Nats-* headers are not
copied. It is a new job at the end of its partition, with a new sequence and
job ID, and runs after the jobs already waiting there; but it keeps its
identity: it carries Leasehold-Origin (<scope>/<partition>/<seq>, where the job
was first stored: the dead letter's own Leasehold-Origin, or its Leasehold-Seq
for a dead letter written before origins were), and its effects take the keys
they had at its first run, so a sink that dedupes applies what the job applied
before once. A dead letter whose origin cannot be read is refused and kept.
Before the dead letter is deleted, a record of the replay is stored beside it,
so that ` + "`leasehold jobs show`" + ` of the job says "replayed as <partition>:<seq>" and
` + "`leasehold jobs wait`" + ` follows it to the replay.

Effects (--sink): the effect goes back on its effect log subject, the
Leasehold-Sink-Subject header, which must be stored by --log (default
<prefix>-effects), with its stamp (Leasehold-Scope, -Partition, -Epoch,
-Acquisition, -Key, -Worker) and trace context only: not the job headers
(Leasehold-Job, -Attempt, -Effects, -After, -Abort) that tie it to its job's
attempt, which the sink has settled. It stands alone: the sink fences it by its
epoch and dedupes it by its key like any effect that stands alone. If the
partition changed hands since it was written, its epoch is below the fence and
the sink refuses it (counted and logged); then re-run the job instead.

Both carry Leasehold-Replay-Of (<dead-letter stream>/<sequence>) and
Leasehold-Replay-Reason (the error that dead-lettered them, on one line, at
most 512 bytes).

A replay is at least once. The dead letter is deleted only after the replay is
stored, so a failed delete, or a stop between the two, leaves it in place and a
second replay sends it again. Within the target stream's duplicate window
(2 minutes by default) the server drops that second copy, since each replay's
message ID is derived from its dead letter; after it, the job runs twice, under
the same keys, which a sink that dedupes applies once.

A dead letter without its original subject, or whose subject no stream stores
or another stream than the expected one stores, is refused and kept: look at
it with show, then purge it. --all replays every dead letter stored when the
command starts, oldest first, and stops at the first it cannot replay.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			all = all && cmd.Flags().Changed("all")
			seqs, err := parseTargets(args, all)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			d, err := f.open(ctx, "replay")
			if err != nil {
				return err
			}
			defer d.nc.Close()
			out := cmd.OutOrStdout()
			n := 0
			replay := func(m *jetstream.RawStreamMsg) (bool, error) {
				if err := d.replay(ctx, out, m); err != nil {
					return false, fmt.Errorf("%w\n%d replayed before it", err, n)
				}
				n++
				return true, nil
			}
			if all {
				if _, err := d.each(ctx, 1, replay); err != nil {
					return err
				}
			}
			for _, seq := range seqs {
				m, err := d.get(ctx, seq)
				if err == nil {
					_, err = replay(m)
				}
				if err != nil {
					return err
				}
			}
			fmt.Fprintf(out, "%d replayed\n", n)
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&all, "all", false, "replay every dead letter (command line only)")
	cmd.Flags().StringVar(&f.log, "log", "", "with --sink: the effect log replayed effects go to (default <prefix>-effects)")
	return cmd
}

// plan is the message a replay of dead letter m publishes and the stream
// that is to store it, or why there is none.
func (d *dlq) plan(ctx context.Context, m *jetstream.RawStreamMsg) (*nats.Msg, string, error) {
	msg, err := d.replayMsg(m)
	if err != nil {
		return nil, "", err
	}
	target, err := d.target(ctx, msg.Subject)
	if err != nil {
		return nil, "", err
	}
	if !d.sink {
		job, err := d.jobOf(m, msg.Subject)
		if err != nil {
			return nil, "", err
		}
		job.origin.SetHeader(msg.Header)
	}
	return msg, target, nil
}

// replayMsg builds the message a replay of dead letter m publishes, from
// its headers alone: for a job, its own headers (the job's origin is set
// by plan); for an effect, its stamp and trace context. Both name the dead
// letter they replay and why it failed.
func (d *dlq) replayMsg(m *jetstream.RawStreamMsg) (*nats.Msg, error) {
	name := worker.HeaderSubject
	subject := header(m.Header, name)
	if d.sink {
		name = sinkHeaderSubject
		subject = sinkHeader(m.Header, name, "Subject")
	}
	if subject == "" {
		return nil, fmt.Errorf("it has no %s header naming the subject it came from", name)
	}
	if err := literalSubject(subject); err != nil {
		return nil, fmt.Errorf("its %s header %s: %w", name, clean(subject), err)
	}
	msg := &nats.Msg{Subject: subject, Data: m.Data, Header: nats.Header{}}
	var reason string
	if d.sink {
		// The stamp and the trace context only: the job headers
		// (Leasehold-Job, -Attempt, -Effects, -After, -Abort) tie the
		// effect to an attempt the sink has settled, and with them it
		// would be dropped as applied, or held for ever for the rest of
		// its group. Alone, it is fenced by its epoch and deduped by its
		// key like any effect that stands alone.
		st, err := leasehold.StampFromHeader(m.Header)
		if err != nil {
			return nil, fmt.Errorf("its stamp cannot be read (%v): a sink would refuse the replay", err)
		}
		st.SetHeader(msg.Header)
		for k, vs := range m.Header {
			if isTraceHeader(k) {
				msg.Header[k] = vs
			}
		}
		reason = sinkHeader(m.Header, sinkHeaderError, "Error")
	} else {
		for k, vs := range m.Header {
			if keepJobHeader(k) {
				msg.Header[k] = vs
			}
		}
		reason = header(m.Header, worker.HeaderError)
	}
	msg.Header.Set(leasehold.HeaderReplayOf, worker.ReplayOf(d.name, m.Sequence))
	if reason = replayReason(reason); reason != "" {
		msg.Header.Set(leasehold.HeaderReplayReason, reason)
	}
	// Derived from the dead letter, so that the target's duplicate window
	// drops a second replay of it; the stored time tells apart dead
	// letters of a stream that was deleted and made again.
	msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("%s.%d.%d.replay", d.name, m.Sequence, m.Time.UnixNano()))
	return msg, nil
}

// keepJobHeader: a dead letter holds the job's own headers, minus Nats-*
// and Leasehold-* (the worker strips those), plus Leasehold-* headers of
// its own: only the job's go back, and trace context, so that the replay
// joins the job's trace. The job's kind (Leasehold-Kind) goes back too:
// it routes the replay to its handler. Its origin is set apart.
func keepJobHeader(k string) bool {
	return strings.EqualFold(k, worker.HeaderKind) || !hasPrefixFold(k, "Nats-") && !hasPrefixFold(k, "Leasehold-")
}

// isTraceHeader reports whether k is W3C trace context or baggage.
func isTraceHeader(k string) bool {
	return strings.EqualFold(k, "traceparent") || strings.EqualFold(k, "tracestate") || strings.EqualFold(k, "baggage")
}

// replayReason makes a dead letter's error fit leasehold.HeaderReplayReason:
// printable text on one line, at most leasehold.MaxReplayReason bytes, cut
// at a rune.
func replayReason(s string) string {
	var b strings.Builder
	for _, r := range strings.ToValidUTF8(s, "?") {
		if !unicode.IsPrint(r) {
			r = ' '
		}
		if b.Len()+utf8.RuneLen(r) > leasehold.MaxReplayReason-3 {
			b.WriteString("...")
			break
		}
		b.WriteRune(r)
	}
	return strings.TrimSpace(b.String())
}

// deadJob is what a job's dead letter says of the job.
type deadJob struct {
	partition leasehold.Partition // where it was dead-lettered
	seq       uint64              // its sequence there: where its status is asked for
	origin    leasehold.Origin    // its identity
	reason    string              // the error, fit for a record
}

// jobOf reads the job a dead letter holds, whose subject (already
// checked) is subject. The origin is the dead letter's Leasehold-Origin,
// or for a dead letter written before origins were, the job's own place.
// One that cannot be read is refused: a replay under the keys of its new
// place would apply again what the job applied.
func (d *dlq) jobOf(m *jetstream.RawStreamMsg, subject string) (deadJob, error) {
	p, err := leasehold.ParsePartition(strings.TrimPrefix(subject, d.prefix+".jobs."))
	if err != nil {
		return deadJob{}, fmt.Errorf("its subject %s names no partition", subject)
	}
	v := header(m.Header, worker.HeaderSeq)
	seq, err := strconv.ParseUint(v, 10, 64)
	if err != nil || seq == 0 || strconv.FormatUint(seq, 10) != v {
		return deadJob{}, fmt.Errorf("its %s header %s names no job sequence, so the job's identity (the keys of its effects) cannot be told", worker.HeaderSeq, clean(strconv.Quote(v)))
	}
	o, ok, err := leasehold.OriginFromHeader(m.Header)
	if err != nil {
		return deadJob{}, fmt.Errorf("%w; a replay under other keys would apply again what the job applied", err)
	}
	if !ok {
		o = leasehold.OriginOf(d.prefix, p, seq)
	}
	return deadJob{partition: p, seq: seq, origin: o, reason: replayReason(header(m.Header, worker.HeaderError))}, nil
}

// records reports whether replays and purges of this stream leave
// records: the worker's dead letters in the job stream's own dead-letter
// stream, the one status reads.
func (d *dlq) records() bool { return !d.sink && d.name == worker.DLQStream(d.prefix) }

// replay publishes dead letter m again, waits for the acknowledgement and
// only then deletes it.
func (d *dlq) replay(ctx context.Context, out io.Writer, m *jetstream.RawStreamMsg) error {
	msg, target, err := d.plan(ctx, m)
	if err != nil {
		return fmt.Errorf("dead letter %d not replayed: %w; it is kept (`leasehold dlq show %d`)", m.Sequence, err, m.Sequence)
	}
	ack, err := d.js.PublishMsg(ctx, msg, jetstream.WithExpectStream(target))
	if err != nil {
		return fmt.Errorf("dead letter %d: the replay to %s failed: %w; the dead letter is kept: replay it again", m.Sequence, msg.Subject, err)
	}
	note := ""
	if ack.Duplicate {
		// The ack says some message with this ID is stored, not that it is
		// this one: anyone may publish on the subject.
		stored, err := d.js.Stream(ctx, ack.Stream)
		var got *jetstream.RawStreamMsg
		if err == nil {
			got, err = stored.GetMsg(ctx, ack.Sequence)
		}
		if err != nil {
			return fmt.Errorf("dead letter %d: %s calls its replay a duplicate of sequence %d, which cannot be read (%w); the dead letter is kept", m.Sequence, ack.Stream, ack.Sequence, err)
		}
		if got.Subject != msg.Subject || !bytes.Equal(got.Data, msg.Data) {
			return fmt.Errorf("dead letter %d: %s holds another message (sequence %d, subject %s) under its replay's message ID; the dead letter is kept: look at both before replaying it", m.Sequence, ack.Stream, ack.Sequence, clean(got.Subject))
		}
		note = ", stored by an earlier replay"
	}
	if d.records() {
		// Before the dead letter goes: the job's status then says where
		// its replay is.
		job, err := d.jobOf(m, msg.Subject)
		if err == nil {
			_, err = worker.StoreRecord(ctx, d.js, d.prefix, worker.Record{Kind: worker.RecordReplayed, Partition: job.partition, Seq: job.seq,
				Origin: job.origin.String(), DeadLetter: m.Sequence, DeadLetterTime: m.Time, Reason: job.reason,
				As: worker.Enqueued{Partition: job.partition, Seq: ack.Sequence}.Ref()})
		}
		if err != nil {
			return fmt.Errorf("dead letter %d was replayed (%s sequence %d) but its record was not stored: %w; the dead letter is kept: replay it again (within the duplicate window the replay is stored once)", m.Sequence, ack.Stream, ack.Sequence, err)
		}
	}
	if err := d.s.DeleteMsg(ctx, m.Sequence); err != nil {
		return fmt.Errorf("dead letter %d was replayed (%s sequence %d) but not deleted: %w; delete it with `leasehold dlq purge %d --yes`, since replaying it again runs it again once the duplicate window has passed", m.Sequence, ack.Stream, ack.Sequence, err, m.Sequence)
	}
	fmt.Fprintf(out, "replayed %d to %s (%s sequence %d%s); dead letter deleted\n", m.Sequence, msg.Subject, ack.Stream, ack.Sequence, note)
	return nil
}

// target is the stream a replay on subject goes to: the job stream, or
// the effect log. Headers are untrusted, so a subject no stream stores, or
// another stream than the expected one stores (a lease bucket's, this
// dead-letter stream), is refused.
func (d *dlq) target(ctx context.Context, subject string) (string, error) {
	want := worker.JobsStream(d.prefix)
	what := "the job stream"
	if d.sink {
		want, what = d.log, "the effect log"
	}
	name, err := d.js.StreamNameBySubject(ctx, subject)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return "", fmt.Errorf("no stream stores its subject %s, so the replay would be lost", subject)
	}
	if err != nil {
		return "", fmt.Errorf("find the stream of subject %s: %w", subject, err)
	}
	if name != want {
		hint := "check --prefix"
		if d.sink {
			hint = "if " + name + " is the sink's effect log, pass --log " + name
		}
		return "", fmt.Errorf("its subject %s is stored by %s, not by %s %s (%s)", subject, name, what, want, hint)
	}
	if !d.sink {
		if err := d.jobPartition(ctx, subject); err != nil {
			return "", err
		}
	}
	return name, nil
}

// jobPartition refuses a job subject that names no partition of the job
// stream: a job there would be stored and never run.
func (d *dlq) jobPartition(ctx context.Context, subject string) error {
	if d.partitions == 0 {
		s, err := d.js.Stream(ctx, worker.JobsStream(d.prefix))
		if err != nil {
			return fmt.Errorf("look up the job stream: %w", err)
		}
		// Recorded by worker.ProvisionJobs.
		n, err := strconv.Atoi(s.CachedInfo().Config.Metadata["leasehold.partitions"])
		if err != nil || n < 1 {
			return fmt.Errorf("the job stream %s does not record its partition count: was it made by `leasehold init`?", worker.JobsStream(d.prefix))
		}
		d.partitions = n
	}
	p, err := leasehold.ParsePartition(strings.TrimPrefix(subject, d.prefix+".jobs."))
	if err != nil || worker.JobSubject(d.prefix, p) != subject || int(p) >= d.partitions {
		return fmt.Errorf("its subject %s is no partition's of the job stream (%s.jobs.0 to %s.jobs.%d): no worker would run it", subject, d.prefix, d.prefix, d.partitions-1)
	}
	return nil
}

func newDLQPurge() *cobra.Command {
	var (
		f        dlqFlags
		all, yes bool
	)
	cmd := &cobra.Command{
		Use:   "purge SEQ... | --all",
		Short: "Delete dead letters for good",
		Long: `purge deletes the dead letters at the given sequences, or with --all every dead
letter stored when the command starts (later ones are kept). A purged job or
effect is gone: show it first, and keep its payload (show --raw) if it may be
needed. Before a job's dead letters are deleted, a record of each purge is
stored beside them, so that ` + "`leasehold jobs show`" + ` says "purged", not "done".
Without --yes, purge lists what it would delete, deletes nothing and
exits non-zero. --yes and --all count only on the command line, never from the
environment or a config file.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			all = all && cmd.Flags().Changed("all")
			yes = yes && cmd.Flags().Changed("yes")
			seqs, err := parseTargets(args, all)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			d, err := f.open(ctx, "purge")
			if err != nil {
				return err
			}
			defer d.nc.Close()
			out := cmd.OutOrStdout()
			l := d.lister(out)
			var st jetstream.StreamState
			var purged []*jetstream.RawStreamMsg // with their headers, for the records
			if all {
				st, err = d.each(ctx, 1, func(m *jetstream.RawStreamMsg) (bool, error) {
					if l.n < 100 {
						l.add(d, m)
					} else {
						l.n++
					}
					if d.records() {
						m.Data = nil
						purged = append(purged, m)
					}
					return true, nil
				})
				if err != nil {
					return err
				}
				if l.n == 0 {
					fmt.Fprintf(out, "no dead letters in %s\n", d.name)
					return nil
				}
			}
			for _, seq := range seqs {
				m, err := d.get(ctx, seq)
				if err != nil {
					return err
				}
				l.add(d, m)
				purged = append(purged, m)
			}
			l.tw.Flush()
			if all && l.n > 100 {
				fmt.Fprintf(out, "... and %d more\n", l.n-100)
			}
			if !yes {
				return fmt.Errorf("nothing deleted: run again with --yes to delete the %d dead letters above", l.n)
			}
			if err := d.recordPurges(ctx, purged); err != nil {
				return err
			}
			if all {
				// Up to the last one listed: a dead letter stored since
				// was not shown, so it stays. The records stay too.
				opts := []jetstream.StreamPurgeOpt{jetstream.WithPurgeSequence(st.LastSeq + 1)}
				if d.records() {
					opts = append(opts, jetstream.WithPurgeSubject(d.prefix+".dlq.*"))
				}
				if err := d.s.Purge(ctx, opts...); err != nil {
					return fmt.Errorf("purge %s: %w", d.name, err)
				}
				fmt.Fprintf(out, "deleted %d dead letters from %s (sequences up to %d)\n", l.n, d.name, st.LastSeq)
				return nil
			}
			for i, seq := range seqs {
				if err := d.s.DeleteMsg(ctx, seq); err != nil {
					return fmt.Errorf("delete dead letter %d of %s: %w (%d deleted before it)", seq, d.name, err, i)
				}
			}
			fmt.Fprintf(out, "deleted %d dead letters from %s\n", len(seqs), d.name)
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&all, "all", false, "every dead letter (command line only)")
	cmd.Flags().BoolVar(&yes, "yes", false, "delete for real (command line only)")
	return cmd
}

// recordPurges stores, before the dead letters are deleted, a record of
// each job's purge, so that its status says purged and not done. A dead
// letter that names no job sequence is no job's that status could find,
// and needs none. Nothing is deleted unless every record is stored.
func (d *dlq) recordPurges(ctx context.Context, ms []*jetstream.RawStreamMsg) error {
	if !d.records() {
		return nil
	}
	for i, m := range ms {
		subject := header(m.Header, worker.HeaderSubject)
		if literalSubject(subject) != nil || d.jobPartition(ctx, subject) != nil {
			continue
		}
		job, err := d.jobOf(m, subject)
		if errors.Is(err, leasehold.ErrBadOrigin) {
			// Its status is asked for at its place; the origin only
			// informs.
			job, err = d.jobOf(withoutOrigin(m), subject)
		}
		if err != nil {
			continue
		}
		_, err = worker.StoreRecord(ctx, d.js, d.prefix, worker.Record{Kind: worker.RecordPurged, Partition: job.partition, Seq: job.seq,
			Origin: job.origin.String(), DeadLetter: m.Sequence, DeadLetterTime: m.Time, Reason: job.reason})
		if err != nil {
			return fmt.Errorf("nothing deleted: the record of the purge of dead letter %d was not stored (%d of %d stored before it): %w", m.Sequence, i, len(ms), err)
		}
	}
	return nil
}

// withoutOrigin is m without its origin header.
func withoutOrigin(m *jetstream.RawStreamMsg) *jetstream.RawStreamMsg {
	c := *m
	c.Header = nats.Header{}
	for k, vs := range m.Header {
		if !strings.EqualFold(k, leasehold.HeaderOrigin) {
			c.Header[k] = vs
		}
	}
	return &c
}

// parseTargets reads the SEQ arguments of replay and purge: some, or none
// with --all.
func parseTargets(args []string, all bool) ([]uint64, error) {
	switch {
	case all && len(args) > 0:
		return nil, errors.New("give sequences or --all, not both")
	case all:
		return nil, nil
	case len(args) == 0:
		return nil, errors.New("name the dead letters by sequence (see `leasehold dlq list`), or pass --all")
	}
	return parseSeqs(args)
}

// literalSubject refuses what cannot be one stream's subject: wildcards,
// empty tokens, spaces and control characters.
func literalSubject(s string) error {
	if len(s) > 1024 {
		return errors.New("longer than any subject leasehold writes")
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" || tok == "*" || tok == ">" {
			return errors.New("not a literal subject")
		}
	}
	for _, r := range s {
		if r <= ' ' || r == 0x7f || !unicode.IsPrint(r) {
			return errors.New("not a literal subject")
		}
	}
	return nil
}
