package statuspage

import (
	"bytes"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/worker"
)

//go:embed assets/index.html assets/page.js assets/page.css
var assets embed.FS

// Config configures a Server.
type Config struct {
	JetStream jetstream.JetStream
	Bucket    *coordinator.Bucket
	Prefix    string
	ServedBy  string // this process, shown on the page
	// Refresh is how often the lease bucket is read again. Default 2s.
	Refresh time.Duration
	// Lag turns on reading each partition's waiting jobs (a short-lived
	// consumer per partition on the job stream, which the user must be
	// allowed to create).
	Lag bool
	// DeadLetters are the dead-letter streams to show.
	DeadLetters []DeadLetterStream
	// Actions turns on the page's actions (off by default); Events is
	// where they are published as events (nil: they are only logged).
	Actions ActionsConfig
	Events  *Publisher
	Logger  *slog.Logger
}

// DeadLetterStream is a dead-letter stream the page shows: its count, and
// with Details its newest dead letters (which needs the right to read its
// messages). With actions on, its dead letters can be replayed and purged
// from the page, as `leasehold dlq replay` and `purge` do (with --sink
// and --log for a sink's).
type DeadLetterStream struct {
	Stream  string
	Details bool
	// Sink says it holds a stream sink's dead letters (effects), which
	// replay into Log (default <prefix>-effects).
	Sink bool
	Log  string
}

// DefaultDeadLetters are the dead-letter streams of the job streams under
// prefix: the workers' and the stream sinks'.
func DefaultDeadLetters(prefix string, workerDetails, sinkDetails bool) []DeadLetterStream {
	return []DeadLetterStream{{Stream: worker.DLQStream(prefix), Details: workerDetails}, {Stream: prefix + "-sink-dlq", Details: sinkDetails, Sink: true}}
}

// Server serves the page. Run feeds it; Register mounts it on a mux.
type Server struct {
	cfg Config

	mu      sync.Mutex
	hist    *history
	snap    State // the last snapshot's tables and dead letters
	evErr   string
	version uint64
	changed chan struct{} // closed and replaced on each change
	stopped chan struct{} // closed when Run returns

	wake     chan struct{} // a viewer came
	poke     chan struct{} // read again now: an action changed something
	acts     *actions
	viewers  int       // open event streams
	lastSeen time.Time // the last request of any viewer
	snapAt   time.Time // when snap was read

	// The last lag counts, owned by refresh.
	lagAt  time.Time
	lags   map[leasehold.Partition]uint64
	lagErr error
}

// New returns a Server; nothing is read until Run.
func New(cfg Config) *Server {
	if cfg.Refresh <= 0 {
		cfg.Refresh = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, hist: newHistory(), changed: make(chan struct{}), stopped: make(chan struct{}), wake: make(chan struct{}, 1), poke: make(chan struct{}, 1)}
	s.acts = newActions(s, cfg.Actions)
	return s
}

// Poke has the page read the lease bucket and the dead letters again
// now, rather than at the next refresh.
func (s *Server) Poke() {
	select {
	case s.poke <- struct{}{}:
	default:
	}
}

// idleAfter is how long the page keeps reading after its last viewer.
const idleAfter = 30 * time.Second

// maxViewers bounds the open event streams of one server: each costs a
// goroutine and an encoding of the state on every change.
const maxViewers = 32

// writeTimeout bounds one write of an event stream.
const writeTimeout = 10 * time.Second

// lagEvery is how often the lag is read again: it takes a request per
// partition.
const lagEvery = 5 * time.Second

// Run feeds the page until ctx ends; open event streams end with it.
// It reads only while someone looks: from the first request on, the lease
// bucket every Refresh and the events stream as it grows, until no viewer
// has been connected for half a minute. A fleet of workers that all serve
// the page costs NATS nothing until someone opens one.
func (s *Server) Run(ctx context.Context) {
	defer close(s.stopped)
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
		}
		s.serve(ctx)
	}
}

// serve reads for viewers until there are none.
func (s *Server) serve(ctx context.Context) {
	sctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); s.followEvents(sctx) }()
	defer func() { cancel(); wg.Wait() }()
	tick := time.NewTicker(s.cfg.Refresh)
	defer tick.Stop()
	for {
		s.refresh(sctx)
		s.mu.Lock()
		watched := s.viewers > 0 || time.Since(s.lastSeen) < idleAfter
		s.mu.Unlock()
		if !watched {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-s.poke:
		}
	}
}

// touch records a viewer's request and wakes Run.
func (s *Server) touch(delta int) {
	s.mu.Lock()
	s.viewers += delta
	s.lastSeen = time.Now()
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Register mounts the page on mux: GET / the page, /status.js and
// /status.css its script and style, /status.json the state once and
// /status/events the state as server-sent events, sent again on every
// change; and the actions (ActionsConfig): GET /actions/session, POST
// /actions/login, /actions/logout, /actions/dlq/replay,
// /actions/dlq/purge and /actions/jobs/cancel.
func (s *Server) Register(mux *http.ServeMux) {
	mux.HandleFunc("GET /{$}", s.index)
	mux.HandleFunc("GET /status.js", s.asset("assets/page.js", "text/javascript; charset=utf-8"))
	mux.HandleFunc("GET /status.css", s.asset("assets/page.css", "text/css; charset=utf-8"))
	mux.HandleFunc("GET /status.json", func(w http.ResponseWriter, r *http.Request) {
		s.touch(0)
		s.waitFresh(r.Context())
		secure(w, "application/json")
		_ = json.NewEncoder(w).Encode(s.State())
	})
	mux.HandleFunc("GET /status/events", s.serveEvents)
	s.acts.register(mux)
}

// statePlaceholder is where the page's HTML takes the state it starts
// with.
const statePlaceholder = "{{STATE}}"

// index serves the page with the state as of now inside it, as a JSON
// block the script renders before the event stream sends the next: a
// page captured as soon as it has loaded (chromium --screenshot, a
// crawler) shows the partitions, not "connecting…". It waits, as
// /status.json does, for a fresh read of the lease bucket. The JSON
// cannot end the block early: encoding/json writes <, > and & as \u
// escapes.
func (s *Server) index(w http.ResponseWriter, r *http.Request) {
	s.touch(0)
	s.waitFresh(r.Context())
	state, err := json.Marshal(s.State())
	if err != nil {
		state = nil
	}
	page, _ := assets.ReadFile("assets/index.html")
	secure(w, "text/html; charset=utf-8")
	_, _ = w.Write(bytes.Replace(page, []byte(statePlaceholder), state, 1))
}

// secure sets the headers of every response: the page runs only its own
// script and style, and nothing it receives can turn into markup.
func secure(w http.ResponseWriter, contentType string) {
	h := w.Header()
	h.Set("Content-Type", contentType)
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
}

func (s *Server) asset(name, contentType string) http.HandlerFunc {
	body, err := assets.ReadFile(name)
	if err != nil {
		panic("statuspage: missing embedded asset " + name)
	}
	return func(w http.ResponseWriter, _ *http.Request) {
		secure(w, contentType)
		_, _ = w.Write(body)
	}
}

// serveEvents streams the state: once at once, then after every change,
// at most every 200ms, with a comment every 15s to keep proxies from
// closing an idle stream.
func (s *Server) serveEvents(w http.ResponseWriter, r *http.Request) {
	_, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	s.mu.Lock()
	full := s.viewers >= maxViewers
	s.mu.Unlock()
	if full {
		w.Header().Set("Retry-After", "10")
		http.Error(w, fmt.Sprintf("%d pages are open already", maxViewers), http.StatusServiceUnavailable)
		return
	}
	s.touch(1)
	defer s.touch(-1)
	secure(w, "text/event-stream")
	w.WriteHeader(http.StatusOK)
	// A client that stops reading would block a write, and hold its
	// slot, for as long as it keeps the connection open.
	rc := http.NewResponseController(w)
	send := func(format string, args ...any) bool {
		_ = rc.SetWriteDeadline(time.Now().Add(writeTimeout))
		if _, err := fmt.Fprintf(w, format, args...); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	keepAlive := time.NewTicker(15 * time.Second)
	defer keepAlive.Stop()
	var sent uint64
	first := true
	for {
		s.mu.Lock()
		version, changed := s.version, s.changed
		s.mu.Unlock()
		if first || version != sent {
			data, err := json.Marshal(s.State())
			if err != nil {
				return
			}
			// JSON holds no newline, so one data line carries it.
			if !send("event: state\ndata: %s\n\n", data) {
				return
			}
			sent, first = version, false
		}
		select {
		case <-r.Context().Done():
			return
		case <-s.stopped:
			return
		case <-keepAlive.C:
			if !send(": keep-alive\n\n") {
				return
			}
		case <-changed:
			select {
			case <-time.After(200 * time.Millisecond):
			case <-r.Context().Done():
				return
			}
		}
	}
}

// waitFresh waits, for a while, until the lease bucket was read within
// two refresh intervals: a page that was idle has nothing recent.
func (s *Server) waitFresh(ctx context.Context) {
	deadline := time.After(max(3*s.cfg.Refresh, 10*time.Second))
	for {
		s.mu.Lock()
		fresh, changed := time.Since(s.snapAt) < 2*s.cfg.Refresh, s.changed
		s.mu.Unlock()
		if fresh {
			return
		}
		select {
		case <-changed:
		case <-deadline:
			return
		case <-ctx.Done():
			return
		case <-s.stopped:
			return
		}
	}
}

// State returns what the page shows now.
func (s *Server) State() State {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.snap
	st.Now = time.Now()
	st.Prefix, st.ServedBy = s.cfg.Prefix, s.cfg.ServedBy
	st.Moves = newestFirst(s.hist.moves)
	st.Losses = newestFirst(s.hist.losses)
	st.Refusals = newestFirst(s.hist.refusals)
	st.Actions = newestFirst(s.hist.actions)
	st.Destinations = s.hist.destinations()
	st.ActionsOn = s.cfg.Actions.Enabled()
	st.Invalid = s.hist.invalid
	st.Errors = append([]string{}, st.Errors...)
	if s.evErr != "" {
		st.Errors = append(st.Errors, s.evErr)
	}
	for _, l := range []*[]Row{&st.Partitions, &st.Locks} {
		if *l == nil {
			*l = []Row{}
		}
	}
	for _, l := range []*[]string{&st.Members, &st.Findings} {
		if *l == nil {
			*l = []string{}
		}
	}
	if st.DeadLetters == nil {
		st.DeadLetters = []DeadLetters{}
	}
	return st
}

// notify marks a change. Called with s.mu held.
func (s *Server) notify() {
	s.version++
	close(s.changed)
	s.changed = make(chan struct{})
}

// refresh reads the lease bucket, the lag and the dead letters.
func (s *Server) refresh(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, max(s.cfg.Refresh, 5*time.Second))
	defer cancel()
	var next State
	now := time.Now()
	if s.cfg.Bucket != nil {
		st, err := s.cfg.Bucket.Snapshot(rctx)
		if err != nil {
			next.Errors = append(next.Errors, "lease bucket: "+err.Error())
		} else {
			next.Partitions, next.Locks = Rows(st, now)
			next.Members = st.Members
			for _, f := range st.Findings {
				next.Findings = append(next.Findings, f.String())
			}
			if s.cfg.Lag {
				if err := s.lag(rctx, st, next.Partitions, now); err != nil {
					next.Errors = append(next.Errors, "lag: "+err.Error())
				}
			}
		}
	}
	for _, d := range s.cfg.DeadLetters {
		next.DeadLetters = append(next.DeadLetters, s.deadLetters(rctx, d))
	}
	if ctx.Err() != nil {
		return
	}
	s.mu.Lock()
	s.snap, s.snapAt = next, now
	s.hist.expire(now.Add(-EventsMaxAge))
	s.notify()
	s.mu.Unlock()
}

// lag counts the jobs after each partition's committed progress, with a
// short-lived consumer per partition, every lagEvery; in between it shows
// the last counts. Only refresh calls it.
func (s *Server) lag(ctx context.Context, st coordinator.Status, rows []Row, now time.Time) error {
	if now.Sub(s.lagAt) < lagEvery && s.lags != nil {
		for i, p := range st.Partitions {
			if n, ok := s.lags[p.Partition]; ok && i < len(rows) {
				rows[i].Lag = fmt.Sprint(n)
			}
		}
		return s.lagErr
	}
	s.lagAt, s.lags, s.lagErr = now, map[leasehold.Partition]uint64{}, nil
	stream := worker.JobsStream(s.cfg.Prefix)
	for i, p := range st.Partitions {
		if i >= len(rows) || i >= 1024 {
			break
		}
		cfg := jetstream.ConsumerConfig{
			FilterSubject:     worker.JobSubject(s.cfg.Prefix, p.Partition),
			AckPolicy:         jetstream.AckNonePolicy,
			MemoryStorage:     true,
			InactiveThreshold: 30 * time.Second,
		}
		if p.Progress > 0 {
			cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, p.Progress+1
		}
		c, err := s.cfg.JetStream.CreateConsumer(ctx, stream, cfg)
		if err != nil {
			s.lagErr = fmt.Errorf("partition %d: %w", p.Partition, err)
			return s.lagErr
		}
		n := c.CachedInfo().NumPending
		s.lags[p.Partition] = n
		rows[i].Lag = fmt.Sprint(n)
		_ = s.cfg.JetStream.DeleteConsumer(ctx, stream, c.CachedInfo().Name)
	}
	return nil
}

// followEvents reads the events stream from an hour ago on, and keeps
// reading it; while the stream is missing it says so and tries again.
func (s *Server) followEvents(ctx context.Context) {
	for ctx.Err() == nil {
		err := s.readEvents(ctx)
		if ctx.Err() != nil {
			return
		}
		s.mu.Lock()
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			s.evErr = fmt.Sprintf("events stream %s: not found: `leasehold init` creates it, and so do worker.ProvisionJobs and statuspage.ProvisionEvents in a program of your own; take-overs and refusals show once it exists", EventsStream(s.cfg.Prefix))
		} else {
			s.evErr = fmt.Sprintf("events stream %s: %v", EventsStream(s.cfg.Prefix), err)
		}
		s.notify()
		s.mu.Unlock()
		select {
		case <-ctx.Done():
		case <-time.After(3 * time.Second):
		}
	}
}

func (s *Server) readEvents(ctx context.Context) error {
	start := time.Now().Add(-EventsMaxAge)
	s.mu.Lock()
	s.hist = newHistory() // a new reader starts from the window's beginning
	s.mu.Unlock()
	cons, err := s.cfg.JetStream.OrderedConsumer(ctx, EventsStream(s.cfg.Prefix), jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverByStartTimePolicy,
		OptStartTime:  &start,
	})
	if err != nil {
		return err
	}
	s.mu.Lock()
	if s.evErr != "" {
		s.evErr = ""
		s.notify()
	}
	s.mu.Unlock()
	for ctx.Err() == nil {
		batch, err := cons.Fetch(200, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return err
		}
		var got []Event
		bad := 0
		for m := range batch.Messages() {
			e, err := decodeEvent(s.cfg.Prefix, m.Subject(), m.Data())
			if err != nil {
				bad++
				continue
			}
			got = append(got, e)
		}
		if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, jetstream.ErrNoMessages) {
			return err
		}
		if len(got) == 0 && bad == 0 {
			continue
		}
		s.mu.Lock()
		for _, e := range got {
			s.hist.add(e)
		}
		s.hist.invalid += bad
		s.notify()
		s.mu.Unlock()
	}
	return ctx.Err()
}

// decodeEvent reads one event from the stream, as untrusted input: its
// size, its JSON, its fields and that its subject is the one its kind is
// published on.
func decodeEvent(prefix, subject string, data []byte) (Event, error) {
	var e Event
	if len(data) > MaxEventSize {
		return e, fmt.Errorf("%w: %d bytes", ErrBadEvent, len(data))
	}
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		return e, fmt.Errorf("%w: %w", ErrBadEvent, err)
	}
	if err := e.Validate(); err != nil {
		return e, err
	}
	if k := kindOfSubject(prefix, subject); k != e.Kind {
		return e, fmt.Errorf("%w: a %s event on subject %s", ErrBadEvent, e.Kind, clip(subject))
	}
	if e.Time.After(time.Now().Add(time.Minute)) {
		// A clock far ahead would keep the event on the page for ever.
		e.Time = time.Now()
	}
	return e, nil
}
