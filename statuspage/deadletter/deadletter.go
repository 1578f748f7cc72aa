// Package deadletter replays and purges dead letters: what `leasehold dlq
// replay` and `leasehold dlq purge` do, and what the status page's actions
// do, in one place so that both keep the same semantics.
//
// A replayed job keeps its identity: it carries Leasehold-Origin, its
// effects take the keys they had at its first run, and a record of the
// replay (or of a purge) is stored beside the dead letter before the dead
// letter is deleted, so that the job's status says "replayed as <ref>" or
// "purged", never "done". A replayed effect (a stream sink's dead letter)
// goes back to the effect log with its stamp and trace context only.
//
// Dead letters come from the network: their headers are checked before
// anything is published from them.
package deadletter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

// Headers of the stream sink's dead letters. They are also read loosely
// (any Leasehold-Sink-* header ending in Error or Subject), so that the
// dead letters of another release replay too.
const (
	sinkHeaderPrefix  = "Leasehold-Sink-"
	sinkHeaderError   = "Leasehold-Sink-Error"
	sinkHeaderSubject = "Leasehold-Sink-Subject"
)

// Stream is an open dead-letter stream: a job stream's (<prefix>-dlq) or a
// stream sink's (<prefix>-sink-dlq, Sink).
type Stream struct {
	js     jetstream.JetStream
	s      jetstream.Stream
	name   string
	sink   bool
	prefix string
	log    string // the effect log sink dead letters replay into

	partitions int // the job stream's, once looked up
}

// New returns the dead-letter stream s (looked up with js.Stream) of the
// job streams under prefix. sink says it holds a stream sink's dead
// letters, which replay into the effect log log (default
// <prefix>-effects).
func New(js jetstream.JetStream, s jetstream.Stream, prefix string, sink bool, log string) *Stream {
	if log == "" {
		log = worker.EffectsStream(prefix)
	}
	d := &Stream{js: js, s: s, sink: sink, prefix: prefix, log: log}
	if s != nil {
		d.name = s.CachedInfo().Config.Name
	}
	return d
}

// Named is a Stream that only builds replay messages (ReplayMsg): for
// tests and for what shows a replay without sending it.
func Named(name, prefix string, sink bool) *Stream {
	return &Stream{name: name, prefix: prefix, sink: sink, log: worker.EffectsStream(prefix)}
}

// Name is the dead-letter stream's name.
func (d *Stream) Name() string { return d.name }

// Sink reports whether it holds a stream sink's dead letters.
func (d *Stream) Sink() bool { return d.sink }

// Get reads the dead letter at seq.
func (d *Stream) Get(ctx context.Context, seq uint64) (*jetstream.RawStreamMsg, error) {
	m, err := d.s.GetMsg(ctx, seq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, fmt.Errorf("no dead letter at sequence %d in %s (replayed, purged or never there): `leasehold dlq list` shows what there is", seq, d.name)
	}
	if err != nil {
		return nil, fmt.Errorf("read dead letter %d of %s: %w", seq, d.name, err)
	}
	if d.IsRecord(m) {
		return nil, fmt.Errorf("sequence %d of %s is no dead letter but a record of what became of one (see worker.Record): `leasehold dlq list` shows the dead letters", seq, d.name)
	}
	return m, nil
}

// IsRecord reports whether m is a record the worker or a replay or purge
// left in a job stream's dead-letter stream: no dead letter.
func (d *Stream) IsRecord(m *jetstream.RawStreamMsg) bool {
	return !d.sink && worker.IsRecordSubject(d.prefix, m.Subject)
}

// Plan is the message a replay of dead letter m publishes and the stream
// that is to store it, or why there is none.
func (d *Stream) Plan(ctx context.Context, m *jetstream.RawStreamMsg) (*nats.Msg, string, error) {
	msg, err := d.ReplayMsg(m)
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

// ReplayMsg builds the message a replay of dead letter m publishes, from
// its headers alone: for a job, its own headers (the job's origin is set
// by Plan); for an effect, its stamp and trace context. Both name the dead
// letter they replay and why it failed.
func (d *Stream) ReplayMsg(m *jetstream.RawStreamMsg) (*nats.Msg, error) {
	name := worker.HeaderSubject
	subject := Header(m.Header, name)
	if d.sink {
		name = sinkHeaderSubject
		subject = SinkHeader(m.Header, name, "Subject")
	}
	if subject == "" {
		return nil, fmt.Errorf("it has no %s header naming the subject it came from", name)
	}
	if err := literalSubject(subject); err != nil {
		return nil, fmt.Errorf("its %s header %s: %w", name, Clean(subject), err)
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
		reason = SinkHeader(m.Header, sinkHeaderError, "Error")
	} else {
		for k, vs := range m.Header {
			if keepJobHeader(k) {
				msg.Header[k] = vs
			}
		}
		reason = Header(m.Header, worker.HeaderError)
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
// place would apply again what the job applied. So is one in the job's
// own partition past its place: a job is first stored at or before where
// it is dead-lettered, and a replay under the keys of a place still to
// come would pre-empt the effects of the job stored there.
func (d *Stream) jobOf(m *jetstream.RawStreamMsg, subject string) (deadJob, error) {
	p, err := leasehold.ParsePartition(strings.TrimPrefix(subject, d.prefix+".jobs."))
	if err != nil {
		return deadJob{}, fmt.Errorf("its subject %s names no partition", subject)
	}
	v := Header(m.Header, worker.HeaderSeq)
	seq, err := strconv.ParseUint(v, 10, 64)
	if err != nil || seq == 0 || strconv.FormatUint(seq, 10) != v {
		return deadJob{}, fmt.Errorf("its %s header %s names no job sequence, so the job's identity (the keys of its effects) cannot be told", worker.HeaderSeq, Clean(strconv.Quote(v)))
	}
	o, ok, err := leasehold.OriginFromHeader(m.Header)
	if err != nil {
		return deadJob{}, fmt.Errorf("%w; a replay under other keys would apply again what the job applied", err)
	}
	if !ok {
		o = leasehold.OriginOf(d.prefix, p, seq)
	}
	if o.Scope == d.prefix && o.Partition == p && o.Seq > seq {
		// The job was first stored at or before where it was
		// dead-lettered: an origin past that names a job still to come,
		// whose keys the replay would take.
		return deadJob{}, fmt.Errorf("%w; its origin comes after the job it was dead-lettered as (sequence %d of partition %d): no job is made from one stored later, so it is forged", &leasehold.OriginError{Value: o.String(), Err: errors.New("an origin past its job")}, seq, p)
	}
	return deadJob{partition: p, seq: seq, origin: o, reason: replayReason(Header(m.Header, worker.HeaderError))}, nil
}

// Records reports whether replays and purges of this stream leave
// records: the worker's dead letters in the job stream's own dead-letter
// stream, the one a job's status reads.
func (d *Stream) Records() bool { return !d.sink && d.name == worker.DLQStream(d.prefix) }

// Replayed is what a replay stored.
type Replayed struct {
	DeadLetter uint64 // the dead letter's sequence
	Subject    string // where the replay went
	Stream     string // the stream that stored it
	Seq        uint64 // its sequence there
	// Duplicate: an earlier replay of the same dead letter was stored
	// within the target's duplicate window, and this one was not.
	Duplicate bool
	// As is the replayed job's reference ("<partition>:<seq>"), for a
	// job's dead letter.
	As string
}

// Replay publishes dead letter m again, waits for the acknowledgement,
// stores the record of the replay (for a job) and only then deletes the
// dead letter. It is at least once: a failure after the publish keeps the
// dead letter, and a second replay within the target's duplicate window
// is stored once.
func (d *Stream) Replay(ctx context.Context, m *jetstream.RawStreamMsg) (Replayed, error) {
	msg, target, err := d.Plan(ctx, m)
	if err != nil {
		return Replayed{}, fmt.Errorf("dead letter %d not replayed: %w; it is kept (`leasehold dlq show %d`)", m.Sequence, err, m.Sequence)
	}
	ack, err := d.js.PublishMsg(ctx, msg, jetstream.WithExpectStream(target))
	if err != nil {
		return Replayed{}, fmt.Errorf("dead letter %d: the replay to %s failed: %w; the dead letter is kept: replay it again", m.Sequence, msg.Subject, err)
	}
	r := Replayed{DeadLetter: m.Sequence, Subject: msg.Subject, Stream: ack.Stream, Seq: ack.Sequence}
	if ack.Duplicate {
		// The ack says some message with this ID is stored, not that it is
		// this one: anyone may publish on the subject.
		stored, err := d.js.Stream(ctx, ack.Stream)
		var got *jetstream.RawStreamMsg
		if err == nil {
			got, err = stored.GetMsg(ctx, ack.Sequence)
		}
		if err != nil {
			return r, fmt.Errorf("dead letter %d: %s calls its replay a duplicate of sequence %d, which cannot be read (%w); the dead letter is kept", m.Sequence, ack.Stream, ack.Sequence, err)
		}
		// Headers too: a look-alike with the replay's subject and data but
		// another origin, kind or stamp would run as something else while
		// the dead letter was deleted as replayed.
		if got.Subject != msg.Subject || !bytes.Equal(got.Data, msg.Data) || !sameHeaders(got.Header, msg.Header) {
			return r, fmt.Errorf("dead letter %d: %s holds another message (sequence %d, subject %s) under its replay's message ID; the dead letter is kept: look at both before replaying it", m.Sequence, ack.Stream, ack.Sequence, Clean(got.Subject))
		}
		r.Duplicate = true
	}
	if !d.sink {
		if job, err := d.jobOf(m, msg.Subject); err == nil {
			r.As = worker.Enqueued{Partition: job.partition, Seq: ack.Sequence}.Ref()
		}
	}
	if d.Records() {
		// Before the dead letter goes: the job's status then says where
		// its replay is.
		job, err := d.jobOf(m, msg.Subject)
		if err == nil {
			_, err = worker.StoreRecord(ctx, d.js, d.prefix, worker.Record{Kind: worker.RecordReplayed, Partition: job.partition, Seq: job.seq,
				Origin: job.origin.String(), DeadLetter: m.Sequence, DeadLetterTime: m.Time, Reason: job.reason,
				As: worker.Enqueued{Partition: job.partition, Seq: ack.Sequence}.Ref()})
		}
		if err != nil {
			return r, fmt.Errorf("dead letter %d was replayed (%s sequence %d) but its record was not stored: %w; the dead letter is kept: replay it again (within the duplicate window the replay is stored once)", m.Sequence, ack.Stream, ack.Sequence, err)
		}
	}
	if err := d.s.DeleteMsg(ctx, m.Sequence); err != nil {
		return r, fmt.Errorf("dead letter %d was replayed (%s sequence %d) but not deleted: %w; delete it with `leasehold dlq purge %d --yes`, since replaying it again runs it again once the duplicate window has passed", m.Sequence, ack.Stream, ack.Sequence, err, m.Sequence)
	}
	return r, nil
}

// target is the stream a replay on subject goes to: the job stream, or
// the effect log. Headers are untrusted, so a subject no stream stores, or
// another stream than the expected one stores (a lease bucket's, this
// dead-letter stream), is refused.
func (d *Stream) target(ctx context.Context, subject string) (string, error) {
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
func (d *Stream) jobPartition(ctx context.Context, subject string) error {
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

// RecordPurges stores, before the dead letters are deleted, a record of
// each job's purge, so that its status says purged and not done. A dead
// letter that names no job sequence is no job's that status could find,
// and needs none. Nothing is to be deleted unless every record is stored.
func (d *Stream) RecordPurges(ctx context.Context, ms []*jetstream.RawStreamMsg) error {
	if !d.Records() {
		return nil
	}
	for i, m := range ms {
		subject := Header(m.Header, worker.HeaderSubject)
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

// Purge deletes the dead letters at seqs for good, after storing the
// record of each job's purge (RecordPurges). It deletes nothing unless
// every one is a dead letter and every record is stored.
func (d *Stream) Purge(ctx context.Context, seqs ...uint64) error {
	ms := make([]*jetstream.RawStreamMsg, 0, len(seqs))
	for _, seq := range seqs {
		m, err := d.Get(ctx, seq)
		if err != nil {
			return err
		}
		ms = append(ms, m)
	}
	if err := d.RecordPurges(ctx, ms); err != nil {
		return err
	}
	for i, seq := range seqs {
		if err := d.s.DeleteMsg(ctx, seq); err != nil {
			return fmt.Errorf("delete dead letter %d of %s: %w (%d deleted before it)", seq, d.name, err, i)
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

// sameHeaders reports whether a and b hold the same headers with the same
// values, names compared without regard to case. The publish's own
// expectations (Nats-Expected-*) are the publisher's, not the message's.
func sameHeaders(a, b nats.Header) bool {
	fold := func(h nats.Header) map[string][]string {
		out := make(map[string][]string, len(h))
		for k, vs := range h {
			k = strings.ToLower(k)
			if strings.HasPrefix(k, "nats-expected-") {
				continue
			}
			out[k] = append(out[k], vs...)
		}
		return out
	}
	fa, fb := fold(a), fold(b)
	if len(fa) != len(fb) {
		return false
	}
	for k, va := range fa {
		if !slices.Equal(va, fb[k]) {
			return false
		}
	}
	return true
}
