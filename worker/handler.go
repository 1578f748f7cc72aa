package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
)

// Handler handles one job. It runs with a context that ends when the
// partition's lease is lost or released, or the job's timeout passes;
// everything it writes should go through the job (Job.Publish, Job.Emit,
// Job.Apply, Job.NextStamp) so that it carries the lease's epoch.
//
// A nil error means the job is done: once its effects are acknowledged,
// progress moves past it. An error is retried with backoff up to
// Config.MaxAttempts, then the job is dead-lettered; wrap it with Permanent
// to dead-letter at once. An error matching leasehold.ErrStaleEpoch (a sink
// refused this worker's epoch) stops the partition without retrying.
type Handler interface {
	Handle(ctx context.Context, job *Job) error
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, job *Job) error

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, job *Job) error { return f(ctx, job) }

// Middleware wraps a Handler: logging, tracing, metrics, recovery of its
// own. Config.Middleware applies them with the first one outermost.
type Middleware func(Handler) Handler

// Chain wraps h in mw, the first outermost.
func Chain(h Handler, mw ...Middleware) Handler {
	for i := len(mw) - 1; i >= 0; i-- {
		h = mw[i](h)
	}
	return h
}

// JSON adapts a function taking a decoded payload to Handler. A payload
// that does not decode as T is dead-lettered at once: retrying cannot fix
// it.
func JSON[T any](f func(ctx context.Context, job *Job, v T) error) Handler {
	return HandlerFunc(func(ctx context.Context, job *Job) error {
		var v T
		if err := json.Unmarshal(job.Data, &v); err != nil {
			return Permanent(fmt.Errorf("job %d of partition %d is not a JSON %T: %w", job.Seq, job.Partition, v, err))
		}
		return f(ctx, job, v)
	})
}

// Permanent marks err as not worth retrying: the job is dead-lettered at
// once. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// PermanentError is an error that retrying cannot fix.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// IsPermanent reports whether err is, or wraps, a Permanent error.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// PanicError is the error of a handler that panicked. It counts as a failed
// attempt.
//
// Its message is one line, "panic: <value> at <dir/file.go:line>", as it
// appears in logs, events and a dead letter's Leasehold-Error. The whole
// stack is kept once: in the attempt's span (exception.stacktrace) and in
// the dead letter's Leasehold-Stack, which `leasehold dlq show` prints.
type PanicError struct {
	Value any    // what the handler panicked with
	Stack []byte // the stack at the panic
	// At is where the handler panicked, as "dir/file.go:line" (its
	// directory and file only); "" when the stack did not say.
	At string
}

func (e *PanicError) Error() string {
	s := "panic: " + oneLine(fmt.Sprint(e.Value), maxPanicValue)
	if e.At != "" {
		s += " at " + e.At
	}
	return s
}

// maxPanicValue bounds the panic's value in PanicError's message.
const maxPanicValue = 256

// Unwrap returns the panic value when it is an error.
func (e *PanicError) Unwrap() error {
	err, _ := e.Value.(error)
	return err
}

// call runs h, turning a panic into a *PanicError.
func call(ctx context.Context, h Handler, job *Job) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack(), At: panicSite()}
		}
	}()
	return h.Handle(ctx, job)
}

// panicSite is where the panic being recovered was raised: the first
// frame below the runtime's panic machinery, as "dir/file.go:line". It
// is called from the deferred function that recovers.
func panicSite() string {
	var pcs [32]uintptr
	frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs[:])])
	inRuntime := false
	for {
		f, more := frames.Next()
		if strings.HasPrefix(f.Function, "runtime.") {
			inRuntime = true
		} else if inRuntime {
			return path.Base(path.Dir(f.File)) + "/" + path.Base(f.File) + ":" + strconv.Itoa(f.Line)
		}
		if !more {
			return ""
		}
	}
}
