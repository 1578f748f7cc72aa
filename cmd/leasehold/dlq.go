package main

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/statuspage/deadletter"
	"github.com/leasehold/leasehold/worker"
)

// Headers of the stream sink's dead letters. They are also read loosely
// (any Leasehold-Sink-* header ending in Error or Tries, see
// deadletter.SinkHeader), so that the dead letters of another release list
// too; replay reads them in package deadletter.
const (
	sinkHeaderError = "Leasehold-Sink-Error"
	sinkHeaderTries = "Leasehold-Sink-Tries"
)

func newDLQ() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "List, show, replay and purge dead letters",
		Long: `dlq works on the dead-letter streams:

  <prefix>-dlq        jobs that failed every attempt (the worker's; the default)
  <prefix>-sink-dlq   effects a stream sink could not deliver (--sink)

A dead letter keeps the job's (or effect's) payload and headers, and adds
headers that say what went wrong: Leasehold-Error and Leasehold-Attempts on a
job, Leasehold-Sink-* on an effect, and the job's identity (Leasehold-Origin:
where it was first stored, whose keys its effects keep). To work through them:

  leasehold dlq list                  what is there, one line each, with the error
  leasehold dlq show SEQ              one dead letter in full
  ... fix the cause (a bad release, a dependency that was down, a bad payload) ...
  leasehold dlq replay SEQ...         send them back; each is deleted once its
                                      replay is stored
  leasehold dlq purge SEQ... --yes    drop the ones that must never run

list and show only read: they change neither the stream nor its consumers.
Replay and purge of a job leave a record in <prefix>-dlq (on
<prefix>.dlq.record.<partition>, which list skips) before they delete its dead
letter, so that ` + "`leasehold jobs show`" + ` says "replayed as <ref>" or "purged", never
"done", of a job that never succeeded.
Headers are shown as stored, quoted when they hold anything but printable text:
a dead letter comes from the network and is not trusted.`,
		Args: noArgsSuggest,
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	cmd.AddCommand(newDLQList(), newDLQShow(), newDLQReplay(), newDLQPurge())
	return cmd
}

// dlqFlags select a dead-letter stream.
type dlqFlags struct {
	conn   natsFlags
	sink   bool
	stream string
	log    string
}

func (f *dlqFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	f.conn.register(fs)
	fs.BoolVar(&f.sink, "sink", false, "the sink's dead letters (<prefix>-sink-dlq) instead of the worker's (<prefix>-dlq)")
	fs.StringVar(&f.stream, "stream", "", "the dead-letter stream, when it is not the default one")
}

// dlq is an open dead-letter stream.
type dlq struct {
	nc     *nats.Conn
	js     jetstream.JetStream
	s      jetstream.Stream
	name   string
	sink   bool
	prefix string
	log    string // the effect log sink dead letters replay into

	lib *deadletter.Stream // replays and purges, as the status page's actions do
}

func (f *dlqFlags) open(ctx context.Context, sub string) (*dlq, error) {
	name := f.stream
	switch {
	case name != "":
	case f.sink:
		name = f.conn.prefix + "-sink-dlq"
	default:
		name = worker.DLQStream(f.conn.prefix)
	}
	nc, js, err := f.conn.connect(ctx, "leasehold dlq "+sub)
	if err != nil {
		return nil, err
	}
	s, err := js.Stream(ctx, name)
	if err != nil {
		nc.Close()
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			made := "`leasehold init` creates it"
			if f.sink {
				made = "a stream sink creates it when it starts"
			}
			return nil, fmt.Errorf("dead-letter stream %s does not exist (%s): check --prefix, --sink and --stream", name, made)
		}
		return nil, fmt.Errorf("look up dead-letter stream %s: %w", name, err)
	}
	log := f.log
	if log == "" {
		log = worker.EffectsStream(f.conn.prefix)
	}
	return &dlq{nc: nc, js: js, s: s, name: name, sink: f.sink, prefix: f.conn.prefix, log: log,
		lib: deadletter.New(js, s, f.conn.prefix, f.sink, log)}, nil
}

// each calls fn on the dead letters from sequence from on, oldest first, up
// to the last one stored when it started (one that arrives meanwhile waits
// for the next run), until fn returns false. It reads with the stream's get
// API, so the stream and its consumers stay as they are.
func (d *dlq) each(ctx context.Context, from uint64, fn func(*jetstream.RawStreamMsg) (bool, error)) (jetstream.StreamState, error) {
	info, err := d.s.Info(ctx)
	if err != nil {
		return jetstream.StreamState{}, fmt.Errorf("read dead-letter stream %s: %w", d.name, err)
	}
	st := info.State
	if st.Msgs == 0 {
		return st, nil
	}
	if !d.sink {
		// Records are no dead letters: counted apart.
		ri, err := d.s.Info(ctx, jetstream.WithSubjectFilter(d.prefix+".dlq.record.>"))
		if err != nil {
			return st, fmt.Errorf("read dead-letter stream %s: %w", d.name, err)
		}
		for _, n := range ri.State.Subjects {
			st.Msgs -= min(n, st.Msgs)
		}
	}
	for seq := max(from, st.FirstSeq, 1); seq <= st.LastSeq; {
		m, err := d.s.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(">"))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return st, nil
		}
		if err != nil {
			return st, fmt.Errorf("read %s from sequence %d: %w", d.name, seq, err)
		}
		if m.Sequence < seq {
			return st, fmt.Errorf("read %s from sequence %d: the server answered with sequence %d", d.name, seq, m.Sequence)
		}
		if m.Sequence > st.LastSeq {
			return st, nil
		}
		seq = m.Sequence + 1
		if d.isRecord(m) {
			continue
		}
		if more, err := fn(m); err != nil || !more {
			return st, err
		}
	}
	return st, nil
}

// get reads the dead letter at seq.
func (d *dlq) get(ctx context.Context, seq uint64) (*jetstream.RawStreamMsg, error) {
	return d.lib.Get(ctx, seq)
}

// isRecord reports whether m is a record the worker or a replay or purge
// left in a job stream's dead-letter stream: no dead letter.
func (d *dlq) isRecord(m *jetstream.RawStreamMsg) bool {
	return !d.sink && worker.IsRecordSubject(d.prefix, m.Subject)
}

// summary is what list shows of a dead letter, taken from its headers
// as they are.
type summary struct{ partition, id, kind, attempts, err string }

func (d *dlq) summarize(m *jetstream.RawStreamMsg) summary {
	h := m.Header
	s := summary{partition: deadletter.Header(h, leasehold.HeaderPartition)}
	key := deadletter.Header(h, leasehold.HeaderKey)
	// The stamp comes in either form; read it through the parser.
	if st, err := leasehold.StampFromHeader(h); err == nil {
		s.partition, key = st.Partition.String(), st.Key
	}
	if d.sink {
		s.id = key
		s.attempts = deadletter.SinkHeader(h, sinkHeaderTries, "Tries", "Attempts", "Deliveries")
		s.err = deadletter.SinkHeader(h, sinkHeaderError, "Error")
	} else {
		s.id = deadletter.Header(h, worker.HeaderJobID)
		s.kind = deadletter.Header(h, worker.HeaderKind)
		s.attempts = deadletter.Header(h, worker.HeaderAttempts)
		s.err = deadletter.Header(h, worker.HeaderError)
		if s.partition == "" {
			s.partition = m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
		}
	}
	return s
}

// lister prints dead letters as a table.
type lister struct {
	tw    *tabwriter.Writer
	n     int
	last  uint64
	kinds bool // a KIND column: the job's Leasehold-Kind, "-" for none
}

func (d *dlq) lister(out io.Writer) *lister {
	l := &lister{tw: tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)}
	l.kinds = !d.sink
	if d.sink {
		// An effect has no kind: the column would always be empty.
		fmt.Fprintf(l.tw, "SEQ\tTIME\tPARTITION\tKEY\tTRIES\tSIZE\tERROR\n")
	} else {
		fmt.Fprintf(l.tw, "SEQ\tTIME\tPARTITION\tJOB\tKIND\tATTEMPTS\tSIZE\tERROR\n")
	}
	return l
}

func (l *lister) add(d *dlq, m *jetstream.RawStreamMsg) {
	s := d.summarize(m)
	id := cell(s.id, 48)
	if l.kinds {
		id += "\t" + cell(s.kind, 32)
	}
	fmt.Fprintf(l.tw, "%d\t%s\t%s\t%s\t%s\t%d\t%s\n", m.Sequence, m.Time.UTC().Format(time.RFC3339),
		cell(s.partition, 24), id, cell(s.attempts, 8), len(m.Data), cell(s.err, 100))
	l.n++
	l.last = m.Sequence
}

func newDLQList() *cobra.Command {
	var (
		f     dlqFlags
		limit int
		from  uint64
	)
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List dead letters, one line each",
		Long: `list prints one line per dead letter, oldest first: its sequence in the
dead-letter stream (what show, replay and purge take), when it was stored, its
partition, the job's ID and kind (its Leasehold-Kind: which handler of a Mux
ran it; the effect's key with --sink), how many attempts were made, the payload's size in bytes and the last error. It only reads.

A stream holding more than --limit dead letters ends with the --from that lists
the next ones.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			d, err := f.open(ctx, "list")
			if err != nil {
				return err
			}
			defer d.nc.Close()
			out := cmd.OutOrStdout()
			l := d.lister(out)
			more := false
			st, err := d.each(ctx, from, func(m *jetstream.RawStreamMsg) (bool, error) {
				if limit > 0 && l.n == limit {
					more = true
					return false, nil
				}
				l.add(d, m)
				return true, nil
			})
			if err != nil {
				return err
			}
			if l.n == 0 {
				fmt.Fprintf(out, "no dead letters in %s", d.name)
				if from > 1 && st.Msgs > 0 {
					fmt.Fprintf(out, " from sequence %d (it holds %d from %d to %d)", from, st.Msgs, st.FirstSeq, st.LastSeq)
				}
				fmt.Fprintln(out)
				return nil
			}
			l.tw.Flush()
			fmt.Fprintf(out, "\n%d shown; %s holds %d dead letters\n", l.n, d.name, st.Msgs)
			if more {
				fmt.Fprintf(out, "more follow: add --from %d\n", l.last+1)
			}
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().IntVar(&limit, "limit", 100, "list at most this many (0: all)")
	cmd.Flags().Uint64Var(&from, "from", 1, "start at this sequence")
	return cmd
}

func newDLQShow() *cobra.Command {
	var (
		f   dlqFlags
		raw bool
	)
	cmd := &cobra.Command{
		Use:   "show SEQ",
		Short: "Print one dead letter: its headers and payload",
		Long: `show prints the dead letter at sequence SEQ (from list): its subject, when it
was stored, where a replay would send it, every header, the stack of a
handler's panic (its Leasehold-Error says "panic: <value> at <file:line>";
the stack, Leasehold-Stack, is printed whole), and the payload. The
payload is printed as text when it is printable UTF-8; otherwise as base64,
said so, which ` + "`base64 -d`" + ` turns back into the bytes. --raw writes only the
payload's bytes, for a file: ` + "`leasehold dlq show 7 --raw > job-7.bin`" + `.
It only reads.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			seqs, err := parseSeqs(args)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			d, err := f.open(ctx, "show")
			if err != nil {
				return err
			}
			defer d.nc.Close()
			m, err := d.get(ctx, seqs[0])
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if raw {
				_, err := out.Write(m.Data)
				return err
			}
			d.show(ctx, out, m)
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&raw, "raw", false, "write only the payload's bytes")
	return cmd
}

func (d *dlq) show(ctx context.Context, out io.Writer, m *jetstream.RawStreamMsg) {
	fmt.Fprintf(out, "dead letter %d of %s\n", m.Sequence, d.name)
	fmt.Fprintf(out, "  subject: %s\n", deadletter.Clean(m.Subject))
	fmt.Fprintf(out, "  stored:  %s\n", m.Time.UTC().Format(time.RFC3339Nano))
	if msg, target, err := d.lib.Plan(ctx, m); err != nil {
		fmt.Fprintf(out, "  replay:  refused: %v\n", err)
	} else {
		fmt.Fprintf(out, "  replay:  to %s (stream %s)\n", msg.Subject, target)
		if o := msg.Header.Get(leasehold.HeaderOrigin); o != "" {
			fmt.Fprintf(out, "  origin:  %s (the replay's effects keep this job's keys)\n", o)
		}
	}
	fmt.Fprintf(out, "headers (%d):\n", len(m.Header))
	names := make([]string, 0, len(m.Header))
	for k := range m.Header {
		names = append(names, k)
	}
	slices.Sort(names)
	stack := ""
	for _, k := range names {
		for _, v := range m.Header[k] {
			if strings.EqualFold(k, worker.HeaderStack) && stack == "" {
				// A handler's panic: its stack, quoted on one line, is
				// printed whole below.
				if s, err := strconv.Unquote(v); err == nil && s != "" {
					stack = s
					fmt.Fprintf(out, "  %s: (the stack of the handler's panic, below)\n", deadletter.Clean(k))
					continue
				}
			}
			fmt.Fprintf(out, "  %s: %s\n", deadletter.Clean(k), deadletter.Clean(v))
		}
	}
	if stack != "" {
		fmt.Fprintln(out, "stack of the handler's panic:")
		for line := range strings.SplitSeq(strings.TrimRight(stack, "\n"), "\n") {
			fmt.Fprintf(out, "  %s\n", deadletter.Clean(strings.ReplaceAll(line, "\t", "    ")))
		}
	}
	if isText(m.Data) {
		fmt.Fprintf(out, "payload (%d bytes, text):\n%s\n", len(m.Data), m.Data)
		return
	}
	fmt.Fprintf(out, "payload (%d bytes, not printable text: base64 follows; `base64 -d` or --raw gives the bytes):\n", len(m.Data))
	enc := base64.StdEncoding.EncodeToString(m.Data)
	for len(enc) > 76 {
		fmt.Fprintln(out, enc[:76])
		enc = enc[76:]
	}
	fmt.Fprintln(out, enc)
}

func parseSeqs(args []string) ([]uint64, error) {
	seqs := make([]uint64, 0, len(args))
	for _, a := range args {
		seq, err := strconv.ParseUint(a, 10, 64)
		if err != nil || seq == 0 {
			return nil, fmt.Errorf("%q is not a sequence: use the SEQ column of `leasehold dlq list`", a)
		}
		if !slices.Contains(seqs, seq) {
			seqs = append(seqs, seq)
		}
	}
	return seqs, nil
}

// cell is deadletter.Clean(s) cut to n runes for a table, "-" when empty.
func cell(s string, n int) string {
	if s == "" {
		return "-"
	}
	s = deadletter.Clean(s)
	if utf8.RuneCountInString(s) > n {
		s = string([]rune(s)[:n-3]) + "..."
	}
	return s
}

// isText reports whether data prints as text: valid UTF-8 with no control
// characters but newlines and tabs (a carriage return could overwrite what
// was printed before it).
func isText(data []byte) bool {
	if !utf8.Valid(data) {
		return false
	}
	for _, r := range string(data) {
		if !unicode.IsPrint(r) && r != '\n' && r != '\t' {
			return false
		}
	}
	return true
}
