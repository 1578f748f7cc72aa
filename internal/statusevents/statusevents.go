// Package statusevents defines the stream the status page's events live
// in, <prefix>-events, so that what provisions the job streams
// (worker.ProvisionJobs) can create it without importing the status page,
// which sits above the worker. The events themselves, their kinds and
// their checks are the statuspage package's.
package statusevents

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Bounds of the events stream and of one event.
const (
	// MaxAge is how long events are kept: the page shows the last hour.
	MaxAge = time.Hour
	// MaxMsgs and MaxBytes bound the stream whatever publishes to it; the
	// oldest events go first.
	MaxMsgs  = 50_000
	MaxBytes = 64 << 20
	// MaxEventSize bounds one event; a larger one is neither stored nor
	// read.
	MaxEventSize = 2048
)

// Stream is the name of the events stream of the job streams under
// prefix.
func Stream(prefix string) string { return prefix + "-events" }

// Subjects is what the events stream stores: every event is published
// under it.
func Subjects(prefix string) string { return prefix + ".events.>" }

// Config is the events stream's configuration, with replicas replicas
// (the lease bucket's, at least one).
func Config(prefix string, replicas int) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        Stream(prefix),
		Description: "leasehold take-overs, lease losses and refused writes, for the status page",
		Subjects:    []string{Subjects(prefix)},
		Storage:     jetstream.FileStorage,
		Replicas:    max(replicas, 1),
		MaxAge:      MaxAge,
		MaxMsgs:     MaxMsgs,
		MaxBytes:    MaxBytes,
		MaxMsgSize:  MaxEventSize,
		Discard:     jetstream.DiscardOld,
	}
}

// Provision creates the events stream of the job streams under prefix, or
// updates it to Config.
func Provision(ctx context.Context, js jetstream.JetStream, prefix string, replicas int) (jetstream.Stream, error) {
	s, err := js.CreateOrUpdateStream(ctx, Config(prefix, replicas))
	if err != nil {
		return nil, fmt.Errorf("create the status page's events stream %s: %w", Stream(prefix), err)
	}
	return s, nil
}
