package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/kvsink"
)

// sinkReadFlags are the settings of the commands that read a KV sink.
type sinkReadFlags struct {
	conn        natsFlags
	kvBucket    string
	legacyScope string
	asJSON      bool
}

func (f *sinkReadFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	f.conn.register(fs)
	fs.StringVar(&f.kvBucket, "kv-bucket", kvsink.DefaultBucket, "the KV sink's bucket (as given to `leasehold sink --kind kv`)")
	fs.StringVar(&f.legacyScope, "legacy-scope", "", "the scope of values written before fence scopes, as given to the sink")
	fs.BoolVar(&f.asJSON, "json", false, "print JSON")
}

func newSinkLs() *cobra.Command {
	var f sinkReadFlags
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List what a KV sink holds, with the stamp each value was written under",
		Long: `ls lists every key of the KV sink's bucket (--kind kv) with the stamp its value
was written under: the scope (the job stream's prefix, or a lock's
"<namespace>/<name>"), the partition, the epoch and acquisition of the lease,
and the worker; then, for every scope and partition seen, the fence the
bucket records (the highest epoch it accepted, and from whom). Reads go to
the stream leader, so a replica that is behind cannot hide a write.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return f.with(cmd.Context(), func(ctx context.Context, js jetstream.JetStream, s *kvsink.Sink) error {
				effects, bad, err := readEffects(ctx, js, s)
				if err != nil {
					return err
				}
				var fences []sinkFence
				seen := map[leasehold.FenceID]bool{}
				for _, e := range effects {
					id := e.Stamp.Fence()
					if seen[id] || e.Stamp.Scope == "" {
						continue
					}
					seen[id] = true
					st, err := s.Fence(ctx, id)
					if err != nil {
						return err
					}
					fences = append(fences, sinkFence{Scope: id.Scope, Partition: uint32(id.Partition), Epoch: uint64(st.Epoch), Acquisition: st.Acquisition, Holder: st.Holder})
				}
				slices.SortFunc(fences, func(a, b sinkFence) int {
					return cmp.Or(naturalCompare(a.Scope, b.Scope), cmp.Compare(a.Partition, b.Partition))
				})
				out := cmd.OutOrStdout()
				if f.asJSON {
					vals := make([]sinkValue, 0, len(effects))
					for _, e := range effects {
						vals = append(vals, valueOf(e))
					}
					if fences == nil {
						fences = []sinkFence{}
					}
					return writeJSON(out, struct {
						Bucket     string      `json:"bucket"`
						Values     []sinkValue `json:"values"`
						Fences     []sinkFence `json:"fences"`
						Unreadable []badValue  `json:"unreadable,omitempty"`
					}{f.kvBucket, vals, fences, bad})
				}
				printSinkValues(out, f.kvBucket, effects, fences)
				for _, b := range bad {
					fmt.Fprintf(out, "key %s: %s\n", b.Key, printable([]byte(b.Error), 0))
				}
				return nil
			})
		},
	}
	f.register(cmd)
	return cmd
}

func newSinkGet() *cobra.Command {
	var f sinkReadFlags
	cmd := &cobra.Command{
		Use:   "get KEY",
		Short: "Print one value of a KV sink and the stamp it was written under",
		Long: `get prints the value the KV sink's bucket holds under KEY (an effect's subject,
which ` + "`leasehold sink --kind kv`" + ` sets to the effect's idempotency key) and the
stamp it was written under: scope, partition, epoch, acquisition, idempotency
key and worker. A missing key is an error.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			key := args[0]
			if err := kvsink.CheckKey(key); err != nil {
				return fmt.Errorf("KEY %q: %w", key, err)
			}
			return f.with(cmd.Context(), func(ctx context.Context, js jetstream.JetStream, s *kvsink.Sink) error {
				e, ok, err := s.Get(ctx, key)
				if err != nil {
					return err
				}
				if !ok {
					return fmt.Errorf("KEY %q: the bucket %s holds no value for it (`leasehold sink ls` lists its keys)", key, f.kvBucket)
				}
				out := cmd.OutOrStdout()
				if f.asJSON {
					return writeJSON(out, valueOf(e))
				}
				tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
				st := e.Stamp
				fmt.Fprintf(tw, "key\t%s\n", e.Subject)
				fmt.Fprintf(tw, "scope\t%s\n", shown(st.Scope))
				fmt.Fprintf(tw, "partition\t%d\n", st.Partition)
				fmt.Fprintf(tw, "epoch\t%d\n", st.Epoch)
				fmt.Fprintf(tw, "acquisition\t%s\n", shown(st.Acquisition))
				fmt.Fprintf(tw, "idempotency key\t%s\n", shown(st.Key))
				fmt.Fprintf(tw, "worker\t%s\n", shown(st.Worker))
				fmt.Fprintf(tw, "size\t%d bytes\n", len(e.Data))
				tw.Flush()
				fmt.Fprintf(out, "value\n%s\n", printable(e.Data, 0))
				return nil
			})
		},
	}
	f.register(cmd)
	return cmd
}

// with connects, binds the sink's existing bucket without changing it, and
// runs fn.
func (f *sinkReadFlags) with(ctx context.Context, fn func(context.Context, jetstream.JetStream, *kvsink.Sink) error) error {
	nc, js, err := f.conn.connect(ctx, "leasehold sink read")
	if err != nil {
		return err
	}
	defer nc.Close()
	// kvsink.New would create a missing bucket: a reader must not.
	if _, err := js.Stream(ctx, "KV_"+f.kvBucket); errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("--kv-bucket %s: there is no such KV sink bucket (`leasehold sink --kind kv --kv-bucket %s` creates it)", f.kvBucket, f.kvBucket)
	} else if err != nil {
		return fmt.Errorf("look up the KV sink bucket %s: %w", f.kvBucket, err)
	}
	s, err := kvsink.New(ctx, js, kvsink.Config{Bucket: f.kvBucket, LegacyScope: f.legacyScope, Name: "sink-read"})
	if err != nil {
		return err
	}
	return fn(ctx, js, s)
}

// badValue is a key whose value ls cannot read: written around the sink,
// without a stamp or with a broken one.
type badValue struct {
	Key   string `json:"key"`
	Error string `json:"error"`
}

// readEffects reads every value of the sink's bucket. A value it cannot
// read is listed apart rather than failing the whole listing: the
// listing is how an operator finds it.
func readEffects(ctx context.Context, js jetstream.JetStream, s *kvsink.Sink) ([]sink.Effect, []badValue, error) {
	effects, err := s.Effects(ctx)
	if err == nil {
		slices.SortStableFunc(effects, func(a, b sink.Effect) int { return naturalCompare(a.Subject, b.Subject) })
		return effects, nil, nil
	}
	bucket := s.KeyValue().Bucket()
	str, err := js.Stream(ctx, "KV_"+bucket)
	if err != nil {
		return nil, nil, fmt.Errorf("list the keys of the KV sink bucket %s: %w", bucket, err)
	}
	prefix := "$KV." + bucket + "."
	info, err := str.Info(ctx, jetstream.WithSubjectFilter(prefix+">"))
	if err != nil {
		return nil, nil, fmt.Errorf("list the keys of the KV sink bucket %s: %w", bucket, err)
	}
	keys := make([]string, 0, len(info.State.Subjects))
	for subj := range info.State.Subjects {
		if key := strings.TrimPrefix(subj, prefix); !strings.HasPrefix(key, "_leasehold.") { // the sink's own records
			keys = append(keys, key)
		}
	}
	slices.SortFunc(keys, naturalCompare)
	var bad []badValue
	for _, key := range keys {
		e, ok, err := s.Get(ctx, key)
		switch {
		case err != nil:
			bad = append(bad, badValue{Key: key, Error: err.Error()})
		case ok:
			effects = append(effects, e)
		}
	}
	return effects, bad, nil
}

// naturalCompare orders keys as people read them: runs of digits by their
// value, so that orders.3.9 comes before orders.3.10, and orders.3.10
// before orders.3.90; the rest byte by byte. Keys equal that way (007 and
// 7) fall back to byte order, so the order is total.
func naturalCompare(a, b string) int {
	i, j := 0, 0
	for i < len(a) && j < len(b) {
		if isDigit(a[i]) && isDigit(b[j]) {
			ei, ej := digitsEnd(a, i), digitsEnd(b, j)
			x, y := strings.TrimLeft(a[i:ei], "0"), strings.TrimLeft(b[j:ej], "0")
			if c := cmp.Compare(len(x), len(y)); c != 0 {
				return c
			}
			if c := strings.Compare(x, y); c != 0 {
				return c
			}
			i, j = ei, ej
			continue
		}
		if a[i] != b[j] {
			return cmp.Compare(a[i], b[j])
		}
		i, j = i+1, j+1
	}
	if c := cmp.Compare(len(a)-i, len(b)-j); c != 0 {
		return c
	}
	return strings.Compare(a, b)
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

func digitsEnd(s string, i int) int {
	for i < len(s) && isDigit(s[i]) {
		i++
	}
	return i
}

// sinkValue is one value of ls and get --json.
type sinkValue struct {
	Key         string `json:"key"`
	Scope       string `json:"scope"`
	Partition   uint32 `json:"partition"`
	Epoch       uint64 `json:"epoch"`
	Acquisition string `json:"acquisition,omitempty"`
	StampKey    string `json:"idempotency_key"`
	Worker      string `json:"worker,omitempty"`
	Size        int    `json:"size"`
	Value       string `json:"value,omitempty"`        // when it is UTF-8 text
	ValueBytes  []byte `json:"value_base64,omitempty"` // otherwise
	Traceparent string `json:"traceparent,omitempty"`
}

// sinkFence is the fence a KV sink records for one scope and partition.
type sinkFence struct {
	Scope       string `json:"scope"`
	Partition   uint32 `json:"partition"`
	Epoch       uint64 `json:"epoch"`
	Acquisition string `json:"acquisition,omitempty"`
	Holder      string `json:"holder,omitempty"`
}

func valueOf(e sink.Effect) sinkValue {
	v := sinkValue{
		Key: e.Subject, Scope: e.Stamp.Scope, Partition: uint32(e.Stamp.Partition), Epoch: uint64(e.Stamp.Epoch),
		Acquisition: e.Stamp.Acquisition, StampKey: e.Stamp.Key, Worker: e.Stamp.Worker, Size: len(e.Data),
		Traceparent: nats.Header(e.Header).Get("Traceparent"),
	}
	if utf8.Valid(e.Data) {
		v.Value = string(e.Data)
	} else {
		v.ValueBytes = e.Data
	}
	return v
}

func printSinkValues(out io.Writer, bucket string, effects []sink.Effect, fences []sinkFence) {
	if len(effects) == 0 {
		fmt.Fprintf(out, "bucket %s holds no values\n", bucket)
		return
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tSCOPE\tPARTITION\tEPOCH\tACQUISITION\tWORKER\tVALUE")
	for _, e := range effects {
		st := e.Stamp
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\t%s\n", e.Subject, shown(st.Scope), st.Partition, st.Epoch, shown(st.Acquisition), shown(st.Worker), printable(e.Data, 40))
	}
	tw.Flush()
	if len(fences) > 0 {
		fmt.Fprintln(out)
		tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "SCOPE\tPARTITION\tFENCED AT EPOCH\tHOLDER")
		for _, f := range fences {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%s\n", shown(f.Scope), f.Partition, f.Epoch, shown(f.Holder))
		}
		tw.Flush()
	}
	fmt.Fprintf(out, "\n%d values in bucket %s\n", len(effects), bucket)
}

// printable is data as text for a terminal: control characters and
// invalid UTF-8 quoted, cut to limit runes (0: no limit).
func printable(data []byte, limit int) string {
	s := string(data)
	if !utf8.ValidString(s) || strings.ContainsFunc(s, func(r rune) bool { return r < ' ' && r != '\t' || r == 0x7f }) {
		s = strconv.Quote(s)
	}
	if limit > 0 && utf8.RuneCountInString(s) > limit {
		s = string([]rune(s)[:limit-1]) + "…"
	}
	return s
}

// shown is a stamp's field for a terminal: the bucket holds what anyone
// allowed to write it put there, and a header carries escape sequences.
func shown(s string) string { return orDash(printable([]byte(s), 0)) }

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func writeJSON(out io.Writer, v any) error {
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
