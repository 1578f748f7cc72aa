package worker

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
)

// HeaderKind carries a job's kind: which handler of a Mux runs it.
const HeaderKind = "Leasehold-Kind"

// MaxKindLen bounds a kind's length.
const MaxKindLen = 128

// ValidKind accepts a kind of 1 to MaxKindLen bytes of letters, digits and
// '.', '-', '_', ':' and '/'. A kind arrives in a header anyone who can
// publish on a job subject can set, so workers check it too.
func ValidKind(kind string) error {
	if kind == "" {
		return fmt.Errorf("worker: the job kind is empty")
	}
	if len(kind) > MaxKindLen {
		return fmt.Errorf("worker: job kind %.32q... is %d bytes long; the limit is %d", kind, len(kind), MaxKindLen)
	}
	for i := 0; i < len(kind); i++ {
		c := kind[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte(".-_:/", c) >= 0) {
			return fmt.Errorf("worker: job kind %q: use letters, digits and . - _ : / only", kind)
		}
	}
	return nil
}

// Kind is the job's kind ("" when it has none). It is not validated; a Mux
// validates it before routing.
func (j *Job) Kind() string {
	if vs := headerValues(j.Header, HeaderKind); len(vs) > 0 {
		return vs[0]
	}
	return ""
}

// headerValues reads a header case-insensitively: the wire keeps a
// publisher's spelling.
func headerValues(h nats.Header, key string) []string {
	if vs, ok := h[key]; ok {
		return vs
	}
	for k, vs := range h {
		if strings.EqualFold(k, key) {
			return vs
		}
	}
	return nil
}

// Codec turns payloads into bytes and back. JSONCodec is the default.
type Codec interface {
	Marshal(v any) ([]byte, error)
	Unmarshal(data []byte, v any) error
}

// JSONCodec encodes payloads with encoding/json.
var JSONCodec Codec = jsonCodec{}

type jsonCodec struct{}

func (jsonCodec) Marshal(v any) ([]byte, error)      { return json.Marshal(v) }
func (jsonCodec) Unmarshal(data []byte, v any) error { return json.Unmarshal(data, v) }

// Handle registers a typed handler for jobs of kind on mux, decoding
// payloads as JSON. A payload that does not decode as T is dead-lettered at
// once. opts are the kind's own settings (MaxAttempts, Backoff, Timeout,
// KindOrder; the worker's where unset):
//
//	worker.Handle(mux, "email", send, worker.MaxAttempts(10), worker.Timeout(time.Minute))
//
// It panics on an invalid or duplicate kind (see Mux.HandleKind).
func Handle[T any](mux *Mux, kind string, h func(ctx context.Context, job *Job, v T) error, opts ...KindOption) {
	HandleWith(mux, kind, JSONCodec, h, opts...)
}

// HandleWith is Handle with the codec c.
func HandleWith[T any](mux *Mux, kind string, c Codec, h func(ctx context.Context, job *Job, v T) error, opts ...KindOption) {
	if c == nil || h == nil {
		panic(fmt.Sprintf("worker: HandleWith(%q): nil codec or handler", kind))
	}
	mux.HandleKind(kind, HandlerFunc(func(ctx context.Context, job *Job) error {
		var v T
		if err := c.Unmarshal(job.Data, &v); err != nil {
			return Permanent(fmt.Errorf("job %d of partition %d (kind %q) does not decode as %T: %w", job.Seq, job.Partition, kind, v, err))
		}
		return h(ctx, job, v)
	}), opts...)
}

// Enqueue encodes v (as JSON unless WithCodec says otherwise) and enqueues
// it as a job of kind. The job goes to the partition its key hashes to
// (WithKey); without a key, to the one its ID hashes to, which spreads
// jobs with random IDs evenly and keeps a JobID's job on one partition.
// With EnqueueAt or EnqueueIn it is a delayed job.
func Enqueue[T any](ctx context.Context, p *Producer, kind string, v T, opts ...EnqueueOption) (Enqueued, error) {
	if err := ValidKind(kind); err != nil {
		return Enqueued{}, err
	}
	o := enqueueOptions(opts)
	c := o.codec
	if c == nil {
		c = JSONCodec
	}
	data, err := c.Marshal(v)
	if err != nil {
		return Enqueued{}, fmt.Errorf("worker: enqueue a job of kind %q: encode %T: %w", kind, v, err)
	}
	key := o.key
	if key == nil {
		key = []byte(o.id)
	}
	opts = append(opts, JobID(o.id), WithKind(kind))
	return p.Enqueue(ctx, key, data, opts...)
}

// WithKind sets the job's kind (its Leasehold-Kind header), for the untyped
// Producer.Enqueue; the typed Enqueue sets it itself.
func WithKind(kind string) EnqueueOption { return func(o *enqueueOpts) { o.kind = kind } }

// WithKey sets the key a typed Enqueue picks the partition by: jobs of one
// key run in order on one partition.
func WithKey(key []byte) EnqueueOption { return func(o *enqueueOpts) { o.key = key } }

// WithCodec sets the codec a typed Enqueue encodes its payload with.
func WithCodec(c Codec) EnqueueOption { return func(o *enqueueOpts) { o.codec = c } }
