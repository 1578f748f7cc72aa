package statuspage

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
)

// State is what the page shows, as the browser receives it.
type State struct {
	Now        time.Time `json:"now"`
	Prefix     string    `json:"prefix"`
	ServedBy   string    `json:"served_by"`
	Partitions []Row     `json:"partitions"`
	Locks      []Row     `json:"locks"`
	Members    []string  `json:"members"`
	Findings   []string  `json:"findings"`
	// Moves are the take-overs and hand-offs of the last hour, newest
	// first; Losses the leases lost, Refusals the refused writes.
	Moves       []Move        `json:"moves"`
	Losses      []Event       `json:"losses"`
	Refusals    []Event       `json:"refusals"`
	DeadLetters []DeadLetters `json:"dead_letters"`
	// Actions are the actions taken on status pages in the last hour,
	// newest first; Destinations the HTTP relays' endpoints, each as its
	// last event left it.
	Actions      []Event       `json:"actions"`
	Destinations []Destination `json:"destinations"`
	// ActionsOn says this page takes actions (ActionsConfig).
	ActionsOn bool `json:"actions_on"`
	// Errors say what the page could not read, and why.
	Errors []string `json:"errors"`
	// Invalid counts events of the stream that failed validation and are
	// not shown.
	Invalid int `json:"invalid"`
}

// Row is one partition or lock of the status table, as `leasehold status`
// prints it and the page shows it. Epochs are whole: ShortEpoch shortens
// them where people read them.
type Row struct {
	Name     string `json:"name"` // the partition's number or the lock's name
	Holder   string `json:"holder"`
	Epoch    string `json:"epoch"`
	Age      string `json:"age"`
	Renewed  string `json:"renewed"`
	Fenced   string `json:"fenced"`
	Progress string `json:"progress,omitempty"` // partitions only
	Lag      string `json:"lag,omitempty"`      // partitions only, when read
}

// Rows builds the status table's rows of a snapshot: its partitions, then
// its locks. Empty cells are "-". A partition held by its holder's member
// session is renewed with the registration, not in its own record, so its
// Renewed says when the session last was: "1.2s ago (session)", or
// "session ended" once the registration is gone and the partition free to
// take.
func Rows(st coordinator.Status, now time.Time) (partitions, locks []Row) {
	for _, p := range st.Partitions {
		r := row(strconv.FormatUint(uint64(p.Partition), 10), p.Holder, p.Epoch, p.Acquired, p.Renewed, p.FencedEpoch, now)
		switch {
		case p.Holder == "" || p.Session == 0:
		case p.SessionEnded:
			r.Renewed = "session ended"
		default:
			r.Renewed += " (session)"
		}
		r.Progress = strconv.FormatUint(p.Progress, 10)
		partitions = append(partitions, r)
	}
	for _, l := range st.Locks {
		locks = append(locks, row(l.Name, l.Holder, l.Epoch, l.Acquired, l.Renewed, l.FencedEpoch, now))
	}
	return partitions, locks
}

func row(name, holder string, epoch leasehold.Epoch, acquired, renewed time.Time, fenced leasehold.Epoch, now time.Time) Row {
	r := Row{Name: name, Holder: "-", Epoch: "-", Age: "-", Renewed: "-", Fenced: "-"}
	if holder != "" {
		r.Holder, r.Epoch = holder, epoch.String()
		r.Age, r.Renewed = Ago(now, acquired), Ago(now, renewed)
	}
	if fenced != 0 {
		r.Fenced = fenced.String()
	}
	return r
}

// EpochDigits is how many of an epoch's last digits ShortEpoch keeps.
// Epochs are revisions of the lease bucket, started above a floor, so they
// run to sixteen digits; the epochs of one deployment differ in the last
// few, and six tell apart a million acquisitions.
const EpochDigits = 6

// ShortEpoch is an epoch as people read it, its last EpochDigits digits
// after a "…": "…447291" for 1796529141447291. It leaves shorter
// strings, and anything that is not a number, as they are. JSON and
// structured log fields carry the whole epoch.
func ShortEpoch(epoch string) string {
	if len(epoch) <= EpochDigits+1 || strings.Trim(epoch, "0123456789") != "" {
		return epoch
	}
	return "…" + epoch[len(epoch)-EpochDigits:]
}

// Ago says how long before now t was, to a tenth of a second; "-" for no
// time.
func Ago(now, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := now.Sub(t)
	if d < 0 {
		d = 0
	}
	return d.Round(100*time.Millisecond).String() + " ago"
}

// Move is a partition changing hands: a take-over when the previous holder
// did not release it (it crashed, froze or was cut off), a hand-off when
// it did.
type Move struct {
	Time      time.Time `json:"time"`
	Kind      string    `json:"kind"` // "take-over" or "hand-off"
	Scope     string    `json:"scope"`
	Partition uint32    `json:"partition"`
	Lock      string    `json:"lock,omitempty"`
	From      string    `json:"from"`
	FromEpoch uint64    `json:"from_epoch"`
	To        string    `json:"to"`
	Epoch     uint64    `json:"epoch"`
}

// DeadLetters is what one dead-letter stream holds.
type DeadLetters struct {
	Stream string       `json:"stream"`
	Count  uint64       `json:"count"`
	Recent []DeadLetter `json:"recent"` // newest first, when readable
	Error  string       `json:"error,omitempty"`
}

// DeadLetter is one dead letter, as far as its headers tell.
type DeadLetter struct {
	Seq       uint64    `json:"seq"`
	Time      time.Time `json:"time"`
	Subject   string    `json:"subject"`
	Partition string    `json:"partition"`
	ID        string    `json:"id"`
	Error     string    `json:"error"`
}

// Destination is an HTTP relay's endpoint as its last event left it.
type Destination struct {
	Relay    string    `json:"relay"`
	Endpoint string    `json:"endpoint"`
	Origin   string    `json:"origin"`
	Down     bool      `json:"down"`
	Since    time.Time `json:"since"`   // down since its first failure in a row; up since its answer
	Error    string    `json:"error"`   // the last failure, while down
	Updated  time.Time `json:"updated"` // the last event's time
	Source   string    `json:"source"`  // the process that runs the relay
}

// maxListed bounds each list of events the page holds and sends.
const maxListed = 200

// history folds the events of the last hour into the page's lists.
type history struct {
	last     map[leasehold.FenceID]Event // each fence's last acquisition or release
	moves    []Move
	losses   []Event
	refusals []Event
	actions  []Event
	dests    map[destKey]Destination
	invalid  int
}

// destKey names an endpoint of a relay run by a process.
type destKey struct{ source, relay, endpoint string }

func newHistory() *history {
	return &history{last: map[leasehold.FenceID]Event{}, dests: map[destKey]Destination{}}
}

// add folds one validated event.
func (h *history) add(e Event) {
	f := fenceOf(e)
	switch e.Kind {
	case KindAcquired:
		if prev, ok := h.last[f]; ok && prev.Worker != e.Worker && e.Epoch > prev.Epoch {
			m := Move{Time: e.Time, Kind: "take-over", Scope: e.Scope, Partition: e.Partition, Lock: e.Lock, From: prev.Worker, FromEpoch: prev.Epoch, To: e.Worker, Epoch: e.Epoch}
			if prev.Kind == KindReleased {
				m.Kind = "hand-off"
			}
			h.moves = appendBounded(h.moves, m)
		}
		h.last[f] = e
	case KindReleased:
		if prev, ok := h.last[f]; !ok || (prev.Worker == e.Worker && prev.Epoch == e.Epoch) {
			h.last[f] = e
			return
		}
		// Published by another process, a release can arrive after the
		// successor's acquisition: the move it preceded was a hand-off.
		for i := len(h.moves) - 1; i >= 0; i-- {
			m := &h.moves[i]
			if m.Scope == e.Scope && m.Partition == e.Partition && m.From == e.Worker && m.FromEpoch == e.Epoch {
				if m.Kind == "take-over" && !e.Time.After(m.Time) {
					m.Kind = "hand-off"
				}
				break
			}
		}
	case KindLost:
		h.losses = appendBounded(h.losses, e)
	case KindRefused:
		h.refusals = appendBounded(h.refusals, e)
	case KindAction:
		h.actions = appendBounded(h.actions, e)
	case KindEndpoint:
		k := destKey{e.Source, e.Relay, e.Endpoint}
		if _, ok := h.dests[k]; !ok && len(h.dests) >= maxListed {
			return
		}
		d := Destination{Relay: e.Relay, Endpoint: e.Endpoint, Origin: e.Origin, Down: e.Down, Since: e.Since, Updated: e.Time, Source: e.Source}
		if d.Since.IsZero() {
			d.Since = e.Time
		}
		if d.Down {
			d.Error = e.Reason
		}
		h.dests[k] = d
	}
}

// destinations lists the endpoints, by relay and name.
func (h *history) destinations() []Destination {
	out := make([]Destination, 0, len(h.dests))
	for _, d := range h.dests {
		out = append(out, d)
	}
	slices.SortFunc(out, func(a, b Destination) int {
		return strings.Compare(a.Relay+"\x00"+a.Endpoint+"\x00"+a.Source, b.Relay+"\x00"+b.Endpoint+"\x00"+b.Source)
	})
	return out
}

// expire forgets what is older than the window.
func (h *history) expire(before time.Time) {
	h.moves = slices.DeleteFunc(h.moves, func(m Move) bool { return m.Time.Before(before) })
	h.losses = slices.DeleteFunc(h.losses, func(e Event) bool { return e.Time.Before(before) })
	h.refusals = slices.DeleteFunc(h.refusals, func(e Event) bool { return e.Time.Before(before) })
	h.actions = slices.DeleteFunc(h.actions, func(e Event) bool { return e.Time.Before(before) })
	maps.DeleteFunc(h.dests, func(_ destKey, d Destination) bool { return d.Updated.Before(before) })
}

func appendBounded[T any](s []T, v T) []T {
	s = append(s, v)
	if len(s) > maxListed {
		s = slices.Delete(s, 0, len(s)-maxListed)
	}
	return s
}

// newestFirst returns a reversed copy of s.
func newestFirst[T any](s []T) []T {
	out := slices.Clone(s)
	slices.Reverse(out)
	if out == nil {
		out = []T{}
	}
	return out
}
