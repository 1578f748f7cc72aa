package streamsink

import (
	"testing"

	"github.com/leasehold/leasehold"
)

// An effect of a job stored again (a replay) carries its origin's keys and
// the origin in leasehold.HeaderOrigin; the runner takes such a key as the
// job's own only where the origin reads strictly and comes before the job.
func TestKeyNamesOrigin(t *testing.T) {
	st := leasehold.Stamp{Scope: "shop", Partition: 2, Key: "shop.2.7.0"}
	header := func(v ...string) map[string][]string {
		if len(v) == 0 {
			return map[string][]string{}
		}
		return map[string][]string{leasehold.HeaderOrigin: v}
	}
	for _, c := range []struct {
		name   string
		h      map[string][]string
		key    string
		job    uint64
		allows bool
	}{
		{"the replay of job 7 stored at 30", header("shop/2/7"), "shop.2.7.0", 30, true},
		{"its third effect", header("shop/2/7"), "shop.2.7.2", 30, true},
		{"no origin", header(), "shop.2.7.0", 30, false},
		{"an origin after the job", header("shop/2/40"), "shop.2.40.0", 30, false},
		{"the job itself as origin", header("shop/2/30"), "shop.2.30.0", 30, false},
		{"a key of another job than the origin", header("shop/2/7"), "shop.2.8.0", 30, false},
		{"a malformed origin", header("shop/2/07"), "shop.2.7.0", 30, false},
		{"two origins that disagree", header("shop/2/7", "shop/2/6"), "shop.2.7.0", 30, false},
		{"an origin in another partition", header("shop/5/90"), "shop.5.90.1", 30, true},
		{"an abort's key is no effect's", header("shop/2/7"), "shop.2.7.abort.1", 30, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := st
			s.Key = c.key
			if got := keyNamesOrigin(c.h, s, c.job); got != c.allows {
				t.Fatalf("keyNamesOrigin(%v, key %q, job %d) = %v, want %v", c.h, c.key, c.job, got, c.allows)
			}
		})
	}
}
