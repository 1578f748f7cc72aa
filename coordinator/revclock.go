package coordinator

import "time"

// A revClock dates revisions of the lease bucket by this process's own
// clock. The watch delivers each write after the server stored it, so an
// entry at revision r seen at t says that every record still at a revision
// below r has stood unchanged since t at least. That lets an acquisition
// that meets a record it cannot read tell how long the record has stood
// from the watch alone, without the server's timestamps (another machine's
// clock) and without having watched the record itself: without the
// partition records nobody watches them, and a record written over a held
// partition would otherwise be dated from when a taker first met it.
//
// It keeps few samples: one per spacing, and none older than the newest
// one that is already older than horizon, which is all an age compared
// with horizon needs.
type revClock struct {
	spacing, horizon time.Duration
	samples          []revSample // in the order seen
}

type revSample struct {
	rev uint64
	at  time.Time
}

func newRevClock(horizon time.Duration) *revClock {
	return &revClock{spacing: max(horizon/16, time.Millisecond), horizon: horizon}
}

// saw records that revision rev had been stored by time at.
func (c *revClock) saw(rev uint64, at time.Time) {
	if n := len(c.samples); n > 0 {
		last := c.samples[n-1]
		if rev <= last.rev {
			return // a later sample of an earlier revision tells nothing new
		}
		if at.Sub(last.at) < c.spacing {
			return
		}
	}
	c.samples = append(c.samples, revSample{rev: rev, at: at})
	// Drop the samples before the newest one older than the horizon.
	cut := 0
	for i := len(c.samples) - 1; i >= 0; i-- {
		if at.Sub(c.samples[i].at) > c.horizon {
			cut = i
			break
		}
	}
	if cut > 0 {
		c.samples = append(c.samples[:0], c.samples[cut:]...)
	}
}

// wrote records that a write of this process, sent after started, was
// stored at rev, and reports whether that showed the samples to be
// another bucket's. The server numbers one stream's writes in order, and a
// sample seen before the write was sent is of an earlier write, so below
// rev; one at or above it is of a stream that is gone: the lease bucket
// was deleted and created again, starting above the epochs its fence
// records hold but not always above every revision it had issued (the
// renewals and lists after the last acquisition). Kept, such samples would
// date the new bucket's records from before it existed. They all go.
// (Samples seen after the send tell nothing: other writes may follow it.)
func (c *revClock) wrote(rev uint64, started time.Time) bool {
	for i := len(c.samples) - 1; i >= 0; i-- {
		if s := c.samples[i]; s.at.Before(started) {
			if s.rev < rev {
				return false
			}
			c.samples = c.samples[:0]
			return true
		}
	}
	return false
}

// since is the earliest time from which a record still at revision rev is
// known to have stood unchanged, or now when nothing seen is later than it.
func (c *revClock) since(rev uint64, now time.Time) time.Time {
	for _, s := range c.samples {
		if s.rev > rev {
			return s.at
		}
	}
	return now
}
