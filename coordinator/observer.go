package coordinator

import (
	"context"
	"time"

	"github.com/leasehold/leasehold"
)

// EventKind names a lease event.
type EventKind int

// Lease events, in the order a lease sees them.
const (
	EventAcquired    EventKind = iota + 1 // a partition was acquired (Epoch is new)
	EventRenewed                          // a renewal succeeded (Latency is its round trip)
	EventRenewFailed                      // a renewal failed but the lease may still be held (Err)
	EventLost                             // the lease was lost (Reason, Err)
	EventReleased                         // the lease was released on purpose
)

func (k EventKind) String() string {
	switch k {
	case EventAcquired:
		return "acquired"
	case EventRenewed:
		return "renewed"
	case EventRenewFailed:
		return "renew_failed"
	case EventLost:
		return "lost"
	case EventReleased:
		return "released"
	}
	return "unknown"
}

// LostReason says why a lease was lost.
type LostReason string

// Reasons a lease is lost.
const (
	LostRefused  LostReason = "refused"  // the server refused a renewal: another write replaced the lease
	LostDeadline LostReason = "deadline" // the local deadline passed before a renewal succeeded
	LostSession  LostReason = "session"  // the member registration that kept the lease alive ended
)

// Event describes one thing that happened to a lease.
type Event struct {
	Kind      EventKind
	Lease     leasehold.Lease
	Member    bool   // the lease is a membership registration, not a partition
	Lock      string // the lock's name, for a lock (Lease.Scope is its scope)
	Reason    LostReason
	Latency   time.Duration
	Err       error
	Time      time.Time
	Holder    string // for EventLost: who holds the partition now, when known
	NextEpoch leasehold.Epoch
}

// Observer receives lease events; the otel package turns them into spans,
// span events and metrics. Implementations must be fast and must not block.
type Observer interface {
	LeaseEvent(ctx context.Context, e Event)
}

type nopObserver struct{}

func (nopObserver) LeaseEvent(context.Context, Event) {}
