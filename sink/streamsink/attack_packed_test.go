package streamsink_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/sink"
	"github.com/leasehold/leasehold/sink/streamsink"
	"github.com/leasehold/leasehold/testing/natstest"
)

// Forged and malformed packed messages: each is refused whole, as
// sink.BadStamp, with an error that says what is wrong and where; nothing
// of it is applied, and the runner goes on (the good job after it
// applies). An effect whose key names another job is no malformed pack:
// it is set aside as it would be alone, and its job never applies.
func TestPackedForgedRefused(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	type build func(pl *packLog, job uint64) (nats.Header, []byte)
	// entries packs effects of job with the given keys, entry headers and
	// final mark counting them.
	entries := func(pl *packLog, job uint64, keys []string, hs []map[string][]string) (nats.Header, []byte) {
		var body []byte
		for i, k := range keys {
			e := leasehold.PackedEffect{Key: k, Data: []byte(k)}
			if i < len(hs) {
				e.Header = hs[i]
			}
			body = leasehold.AppendPacked(body, e)
		}
		h := nats.Header{}
		pl.stamp(1, keys[len(keys)-1]).SetHeaderAs(h, pl.form)
		leasehold.JobMark{Job: job, Attempt: 1, Effects: len(keys)}.SetHeaderAs(h, pl.form)
		leasehold.SetPackHeader(h, len(keys))
		return h, body
	}
	good := func(pl *packLog, job uint64) (nats.Header, []byte) { return entries(pl, job, keysOf(pl, job, 3), nil) }
	withHeader := func(name string) build {
		return func(pl *packLog, job uint64) (nats.Header, []byte) {
			return entries(pl, job, keysOf(pl, job, 3), []map[string][]string{nil, {name: {"1 x"}}})
		}
	}
	cases := []struct {
		name string
		want string // in the error
		b    build
	}{
		{"count above the entries", "entry 3", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			leasehold.SetPackHeader(h, 4)
			leasehold.JobMark{Job: job, Attempt: 1, Effects: 4}.SetHeaderAs(h, pl.form)
			return h, body
		}},
		{"count below the entries", "follow the last", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			leasehold.SetPackHeader(h, 2)
			leasehold.JobMark{Job: job, Attempt: 1, Effects: 2}.SetHeaderAs(h, pl.form)
			return h, body
		}},
		{"trailing bytes", "follow the last", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			return h, append(body, 0)
		}},
		{"truncated length", "runs past", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			return h, body[:len(body)-1]
		}},
		{"huge uvarint length", "runs past", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			return h, append(binary.AppendUvarint(nil, 1<<63), body...)
		}},
		{"entry with Leasehold-Stamp", "entry 1", withHeader(leasehold.HeaderStamp)},
		{"entry with leasehold-mark", "entry 1", withHeader("leasehold-mark")},
		{"entry with Leasehold-Key", "entry 1", withHeader(leasehold.HeaderKey)},
		{"entry with Leasehold-Job", "entry 1", withHeader(leasehold.HeaderJob)},
		{"entry with Leasehold-Pack", "entry 1", withHeader(leasehold.HeaderPack)},
		{"entry with Leasehold-Barrier", "entry 1", withHeader(leasehold.HeaderBarrier)},
		{"entry with Nats-Msg-Id", "entry 1", withHeader("Nats-Msg-Id")},
		{"entry with NATS-EXPECTED-STREAM", "entry 1", withHeader("NATS-EXPECTED-STREAM")},
		{"duplicate keys", "distinct", func(pl *packLog, job uint64) (nats.Header, []byte) {
			k := pl.key(job, 0)
			return entries(pl, job, []string{k, pl.key(job, 1), k}, nil)
		}},
		{"last key not the stamp's", "not its stamp's", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			pl.stamp(1, pl.key(job, 7)).SetHeaderAs(h, pl.form)
			return h, body
		}},
		{"no job mark", "no job mark", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			leasehold.JobMark{}.SetHeaderAs(h, pl.form)
			return h, body
		}},
		{"a barrier", "barrier", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			h.Set(leasehold.HeaderBarrier, "1")
			return h, body
		}},
		{"an abort marker", "abort", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			leasehold.JobMark{Job: job, Attempt: 1, Abort: true}.SetHeaderAs(h, pl.form)
			return h, body
		}},
		{"a final counting fewer", "counting 2", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			leasehold.JobMark{Job: job, Attempt: 1, Effects: 2}.SetHeaderAs(h, pl.form)
			return h, body
		}},
		{"a count of one", "counts 1", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := entries(pl, job, keysOf(pl, job, 1), nil)
			leasehold.SetPackHeader(h, 1)
			return h, body
		}},
		{"a count above MaxPackEffects", "allowed is", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			h.Set(leasehold.HeaderPack, "1 "+strconv.Itoa(leasehold.MaxPackEffects+1))
			return h, body
		}},
		{"two pack headers", "more than once", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			h["leasehold-pack"] = []string{"1 3"}
			return h, body
		}},
		{"a bad stamp", "bad stamp", func(pl *packLog, job uint64) (nats.Header, []byte) {
			h, body := good(pl, job)
			h.Set(leasehold.HeaderEpoch, "01")
			return h, body
		}},
	}
	for _, form := range []leasehold.StampFormat{leasehold.StampCompact, leasehold.StampLegacy} {
		t.Run(form.String(), func(t *testing.T) {
			js := srv.JetStream(t)
			pl := newPackLog(t, js, "pkbad"+form.String(), form)
			r := start(t, js, pl.cfg)
			want := map[string][]string{}
			prev := uint64(0) // the last job applied
			for i, c := range cases {
				if c.name == "a bad stamp" && form == leasehold.StampCompact {
					continue
				}
				job := uint64(100 + 2*i)
				h, body := c.b(pl, job)
				bad := pl.publish(h, body)
				// The next job, in order after the last applied.
				next := job + 1
				keys := keysOf(pl, next, 2)
				ok := pl.pack(keys, "a1", leasehold.JobMark{Job: next, Attempt: 1, Effects: 2, After: prev})
				pl.wait(r, ok)
				prev = next
				want[keys[0]], want[keys[1]] = []string{"a1"}, []string{"a1"}
				ds := pl.at(bad)
				if len(ds) != 1 || ds[0].Outcome != sink.BadStamp || !errors.Is(ds[0].Err, leasehold.ErrBadStamp) ||
					!strings.Contains(ds[0].Err.Error(), c.want) || !strings.Contains(ds[0].Err.Error(), fmt.Sprintf("log position %d", bad)) {
					t.Errorf("%s: decisions %+v; want one BadStamp saying %q at log position %d", c.name, ds, c.want, bad)
				}
			}
			pl.want(want)
		})
	}
}

// An effect of a pack whose key names another job is set aside
// (SuspectJobKey), as it would be alone: the job's attempt never holds all
// its effects and never applies, and the runner goes on.
func TestPackedKeyOfAnotherJob(t *testing.T) {
	t.Parallel()
	js := natstest.Start(t).JetStream(t)
	pl := newPackLog(t, js, "pkother", leasehold.StampCompact)
	r := start(t, js, pl.cfg)
	keys := []string{pl.key(3, 0), pl.key(4, 1), pl.key(3, 2)}
	forged := pl.pack(keys, "a1", leasehold.JobMark{Job: 3, Attempt: 1, Effects: 3})
	after := pl.one("standalone", "a1", leasehold.JobMark{})
	pl.wait(r, after)
	pl.want(map[string][]string{"standalone": {"a1"}})
	var suspect []string
	for _, d := range pl.at(forged) {
		if d.Suspect != "" {
			suspect = append(suspect, d.Stamp.Key+" "+d.Suspect)
		}
	}
	if want := []string{keys[1] + " " + streamsink.SuspectJobKey}; fmt.Sprint(suspect) != fmt.Sprint(want) {
		t.Fatalf("set aside at %d: %v, want %v", forged, suspect, want)
	}
}
