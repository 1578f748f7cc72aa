// Package statuspage serves leasehold's live status page: the partitions
// and locks of a lease bucket with their holders, epochs and lag, the
// take-overs, hand-offs, lease losses and refused writes of the last hour,
// and the dead letters. The leasehold command serves it on `leasehold status
// --http` and on every worker's and sink's --http address; a program of
// your own serves it the same way (see the example).
//
// Workers and sinks publish what happens to them to a small stream,
// <prefix>-events (ProvisionEvents; `leasehold init` creates it), through
// a Publisher's observers: a bounded queue that drops and counts
// (leasehold_status_events_dropped_total) rather than wait, so the fenced
// path never slows for the page. A Server reads that stream and the lease
// bucket, only while someone has the page open, and pushes each change to
// the browser with server-sent events. The page is plain HTML, one script
// and one style sheet, embedded in the binary: no build step, no CDN, it
// works offline.
//
// With ServeConfig.Actions the page also acts, behind a token or a
// proxy's identity header: it replays and purges dead letters (package
// deadletter, as `leasehold dlq` does) and cancels jobs; each action is an
// event every page shows. An HTTP relay's endpoints that go down and come
// back (Publisher.EndpointObserver) show in its Destinations.
//
// Everything read from the events stream is untrusted: anyone allowed to
// publish there can write anything. Events are validated (kind, subject,
// size, printable strings) before they are shown, the page sets every
// value as text, and its Content-Security-Policy allows only its own
// script.
package statuspage

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/statusevents"
)

// Kinds of events, each published on its own subject so that NATS
// permissions can say who may publish which: workers the lease events,
// sinks the refusals.
const (
	KindAcquired = "acquired" // a worker acquired a partition (Worker, Epoch)
	KindReleased = "released" // a worker drained and released a partition on purpose
	KindLost     = "lost"     // a worker lost a partition's lease (Reason)
	KindRefused  = "refused"  // a sink refused a write (Worker wrote at Epoch; Max and Holder are the fence's)
	// KindAction is an action taken on the status page (Actor did Action
	// on Target, with Result; Failed when it did not succeed).
	KindAction = "action"
	// KindEndpoint is an HTTP relay's endpoint going down (Down, with the
	// last error in Reason, down Since its first failure), still being
	// down, or answering again.
	KindEndpoint = "endpoint"
)

// Bounds of the events stream and of one event.
const (
	// EventsMaxAge is how long events are kept: the page shows the last
	// hour.
	EventsMaxAge = statusevents.MaxAge
	// EventsMaxMsgs and EventsMaxBytes bound the stream whatever publishes
	// to it; the oldest events go first.
	EventsMaxMsgs  = statusevents.MaxMsgs
	EventsMaxBytes = statusevents.MaxBytes
	// MaxEventSize bounds one event; a larger one is neither stored nor
	// read.
	MaxEventSize = statusevents.MaxEventSize
	// maxText bounds every string field of an event.
	maxText = 256
)

// EventsStream is the name of the events stream of the job streams under
// prefix.
func EventsStream(prefix string) string { return statusevents.Stream(prefix) }

// EventSubject is the subject events of kind are published on.
func EventSubject(prefix, kind string) string {
	switch kind {
	case KindRefused:
		return prefix + ".events.refused"
	case KindAction:
		return prefix + ".events.action"
	case KindEndpoint:
		return prefix + ".events.endpoint"
	}
	return prefix + ".events.lease." + kind
}

// kindOfSubject returns the kind a subject may carry, or "".
func kindOfSubject(prefix, subject string) string {
	for _, k := range []string{KindAcquired, KindReleased, KindLost, KindRefused, KindAction, KindEndpoint} {
		if subject == EventSubject(prefix, k) {
			return k
		}
	}
	return ""
}

// Event is one thing the page shows. Which fields are set depends on Kind.
type Event struct {
	Kind      string    `json:"kind"`
	Time      time.Time `json:"time"`
	Source    string    `json:"source"` // the process that published it: a worker's ID, a sink's name
	Scope     string    `json:"scope"`
	Partition uint32    `json:"partition"`
	Lock      string    `json:"lock,omitempty"` // the lock's name, for a lock (Scope is its scope)
	// Worker is the holder that acquired, released or lost the partition,
	// or the writer of a refused write.
	Worker string `json:"worker,omitempty"`
	// Epoch is the acquired, released or lost lease's, or the refused
	// write's.
	Epoch uint64 `json:"epoch,omitempty"`
	// Max, Holder, Outcome and Key describe a refusal: the fence's
	// maximum the write was judged against, who holds the partition now
	// (when the sink knows), how it was refused and the write's
	// idempotency key.
	Max     uint64 `json:"max,omitempty"`
	Holder  string `json:"holder,omitempty"`
	Outcome string `json:"outcome,omitempty"`
	Key     string `json:"key,omitempty"`
	Reason  string `json:"reason,omitempty"` // for a loss; an endpoint's last error
	// Actor, Action, Target, Result and Failed describe an action: who
	// did what, to which dead letter or job, and how it went.
	Actor  string `json:"actor,omitempty"`
	Action string `json:"action,omitempty"`
	Target string `json:"target,omitempty"`
	Result string `json:"result,omitempty"`
	Failed bool   `json:"failed,omitempty"`
	// Relay, Endpoint, Origin, Down and Since describe an HTTP relay's
	// endpoint: down since its first failure in a row, or up again.
	Relay    string    `json:"relay,omitempty"`
	Endpoint string    `json:"endpoint,omitempty"`
	Origin   string    `json:"origin,omitempty"`
	Down     bool      `json:"down,omitempty"`
	Since    time.Time `json:"since,omitzero"`
}

// ErrBadEvent is matched by the errors of events that fail validation.
var ErrBadEvent = errors.New("statuspage: bad event")

// Validate checks an event read from the stream (or about to be written):
// a known kind, a time, and short printable strings.
func (e *Event) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrBadEvent, fmt.Sprintf(format, args...))
	}
	switch e.Kind {
	case KindAcquired, KindReleased, KindLost, KindRefused, KindAction, KindEndpoint:
	default:
		return bad("unknown kind %q", clip(e.Kind))
	}
	if e.Time.IsZero() {
		return bad("no time")
	}
	for name, s := range map[string]string{"source": e.Source, "scope": e.Scope, "lock": e.Lock, "worker": e.Worker, "holder": e.Holder, "outcome": e.Outcome, "key": e.Key, "reason": e.Reason,
		"actor": e.Actor, "action": e.Action, "target": e.Target, "result": e.Result, "relay": e.Relay, "endpoint": e.Endpoint, "origin": e.Origin} {
		if err := checkText(s); err != nil {
			return bad("%s: %v", name, err)
		}
	}
	switch e.Kind {
	case KindAction:
		if e.Actor == "" || e.Action == "" {
			return bad("an action without its actor or name")
		}
		return nil
	case KindEndpoint:
		if e.Endpoint == "" {
			return bad("an endpoint event without the endpoint")
		}
		return nil
	}
	if e.Scope == "" {
		return bad("no scope")
	}
	if e.Kind == KindRefused && e.Outcome == "" {
		return bad("a refusal without an outcome")
	}
	return nil
}

func checkText(s string) error {
	if len(s) > maxText {
		return fmt.Errorf("%d bytes, more than %d", len(s), maxText)
	}
	if !utf8.ValidString(s) {
		return errors.New("not UTF-8")
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return fmt.Errorf("holds the unprintable %U", r)
		}
	}
	return nil
}

// clip shortens s for an error message and makes it printable.
func clip(s string) string {
	if len(s) > 40 {
		s = s[:40] + "..."
	}
	return strings.ToValidUTF8(fmt.Sprintf("%q", s), "?")
}

// truncate cuts s to the bound of a field, on a rune boundary, and drops
// what is not printable, so that what a process publishes about itself
// always validates.
func truncate(s string) string {
	s = strings.Map(func(r rune) rune {
		if r == utf8.RuneError || !unicode.IsPrint(r) {
			return -1
		}
		return r
	}, s)
	for len(s) > maxText {
		_, n := utf8.DecodeLastRuneInString(s)
		s = s[:len(s)-n]
	}
	return s
}

// ProvisionEvents creates or updates the events stream of the job streams
// under prefix, with replicas replicas (the lease bucket's).
// worker.ProvisionJobs and `leasehold init` create it too.
func ProvisionEvents(ctx context.Context, js jetstream.JetStream, prefix string, replicas int) (jetstream.Stream, error) {
	s, err := statusevents.Provision(ctx, js, prefix, replicas)
	if err != nil {
		return nil, fmt.Errorf("statuspage: %w", err)
	}
	return s, nil
}
