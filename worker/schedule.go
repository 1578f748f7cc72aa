package worker

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
)

// Delayed and periodic jobs are scheduled by the NATS server itself
// (nats-server 2.12+, ADR-51 message schedules), not by a timer of ours: a
// schedule is a message in the job stream, on a subject of its own
// ("<prefix>.jobs.at-<hash of the job ID>" or
// "<prefix>.jobs.every-<hash of the name>"), that the stream leader turns
// into a job on the partition subject when it falls due. It survives
// restarts of producers and workers, and the whole fleet sees one job per
// due time however many workers run.

// Headers of scheduled jobs. The server copies a schedule's headers to the
// job it fires (minus Nats-Msg-Id and the Nats-Schedule-* directives) and
// adds Nats-Scheduler (the schedule's subject) and Nats-Schedule-Next.
const (
	HeaderDue      = "Leasehold-Due"      // a delayed job's due time, RFC 3339
	HeaderPeriodic = "Leasehold-Periodic" // the name of the periodic job a tick belongs to
	HeaderEvery    = "Leasehold-Every"    // a periodic job's interval
)

// Server headers of message schedules (ADR-51).
const (
	hdrSchedule       = "Nats-Schedule"
	hdrScheduleTarget = "Nats-Schedule-Target"
	hdrScheduleTZ     = "Nats-Schedule-Time-Zone"
	hdrScheduler      = "Nats-Scheduler"
	hdrScheduleNext   = "Nats-Schedule-Next"
	// hdrTTL "never" exempts a schedule from the job stream's MaxAge,
	// which would otherwise drop it unfired (ADR-43; needs AllowMsgTTL).
	hdrTTL = "Nats-TTL"
)

// ErrNoSchedules is matched by the error of a delayed or periodic enqueue
// on a job stream or server that cannot schedule messages.
var ErrNoSchedules = errors.New("worker: the job stream cannot schedule jobs")

// EnqueueAt makes the job a delayed job: the server stores it on its
// partition at t, rounded up to the second (schedules have one-second
// resolution), and not before. A t in the past runs at once. The job's ID
// deduplicates the schedule within the stream's duplicate window; a delayed
// job enqueued again under the same ID after the window, while the first is
// still waiting, replaces it.
func EnqueueAt(t time.Time) EnqueueOption { return func(o *enqueueOpts) { o.at = t } }

// EnqueueIn is EnqueueAt(time.Now().Add(d)).
func EnqueueIn(d time.Duration) EnqueueOption {
	return func(o *enqueueOpts) { o.at = time.Now().Add(d) }
}

// dueTime rounds t up to the second: the server's schedules are RFC 3339
// times, and a job must not run early.
func dueTime(t time.Time) time.Time {
	if r := t.Truncate(time.Second); !r.Equal(t) {
		return r.Add(time.Second).UTC()
	}
	return t.UTC()
}

// ScheduleSubject is the subject of the schedule of the delayed job with ID
// id.
func ScheduleSubject(prefix, id string) string { return prefix + ".jobs.at-" + subjectHash(id) }

// PeriodicSubject is the subject of the schedule of the periodic job name.
func PeriodicSubject(prefix, name string) string { return prefix + ".jobs.every-" + subjectHash(name) }

func subjectHash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:12])
}

// schedule turns msg, a job bound for partition part, into a schedule that
// the server fires at o.at.
func (p *Producer) schedule(ctx context.Context, msg *nats.Msg, part leasehold.Partition, o enqueueOpts) error {
	if err := p.checkSchedules(ctx, false); err != nil {
		return err
	}
	due := dueTime(o.at)
	msg.Subject = ScheduleSubject(p.cfg.Prefix, o.id)
	msg.Header[hdrSchedule] = []string{"@at " + due.Format(time.RFC3339)}
	msg.Header[hdrScheduleTarget] = []string{JobSubject(p.cfg.Prefix, part)}
	msg.Header[HeaderDue] = []string{due.Format(time.RFC3339)}
	// The server drops Nats-Msg-Id from the job it fires: the job keeps
	// its ID in a header of ours.
	msg.Header[HeaderJobID] = []string{o.id}
	p.neverExpire(msg.Header)
	return nil
}

// neverExpire marks a schedule as exempt from the job stream's MaxAge,
// where the stream has one.
func (p *Producer) neverExpire(h nats.Header) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.schedulesAge {
		h[hdrTTL] = []string{"never"}
	}
}

// checkSchedules checks once that the job stream allows message schedules
// and, for cron, that the server is 2.14 or later.
func (p *Producer) checkSchedules(ctx context.Context, cron bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	nc := p.js.Conn()
	if cron && !serverAtLeast(nc, 2, 14) {
		return fmt.Errorf("%w: nats-server %s does not run cron schedules: they need 2.14 or later (use Periodic.Every, or upgrade the server)", ErrNoSchedules, nc.ConnectedServerVersion())
	}
	if p.schedulesOK {
		return nil
	}
	if !serverAtLeast(nc, 2, 12) {
		return fmt.Errorf("%w: nats-server %s does not schedule messages: delayed and periodic jobs need nats-server 2.12 or later", ErrNoSchedules, nc.ConnectedServerVersion())
	}
	s, err := p.js.Stream(ctx, JobsStream(p.cfg.Prefix))
	if err != nil {
		return fmt.Errorf("worker: look up job stream %s: %w", JobsStream(p.cfg.Prefix), err)
	}
	sc := s.CachedInfo().Config
	if !sc.AllowMsgSchedules {
		return fmt.Errorf("%w: job stream %s does not allow message schedules: %s", ErrNoSchedules, JobsStream(p.cfg.Prefix), whyNoSchedules(sc))
	}
	if sc.MaxAge > 0 && !sc.AllowMsgTTL {
		return fmt.Errorf("%w: job stream %s ages messages out after %v, schedules included, and does not allow the per-message TTL that exempts them: run worker.ProvisionJobs with JobsConfig.Schedules (or `leasehold init --schedules`) again to allow it", ErrNoSchedules, JobsStream(p.cfg.Prefix), sc.MaxAge)
	}
	p.schedulesOK, p.schedulesAge = true, sc.MaxAge > 0
	return nil
}

func whyNoSchedules(c jetstream.StreamConfig) string {
	if c.MaxBytes > 0 || c.MaxMsgs > 0 {
		return "it has a size limit (MaxBytes or MaxMsgs), and a stream that schedules must discard its oldest messages when full, which would drop jobs; provision a job stream without MaxBytes to schedule jobs"
	}
	return "it was provisioned without them; run worker.ProvisionJobs with JobsConfig.Schedules (or `leasehold init --schedules`) to enable them, once only trusted publishers may write job subjects"
}

var versionRE = regexp.MustCompile(`^v?(\d+)\.(\d+)`)

func serverAtLeast(nc *nats.Conn, major, minor int) bool {
	m := versionRE.FindStringSubmatch(nc.ConnectedServerVersion())
	if m == nil {
		return false
	}
	ma, _ := strconv.Atoi(m[1])
	mi, _ := strconv.Atoi(m[2])
	return ma > major || ma == major && mi >= minor
}

// scheduleConfig sets what a job stream that schedules needs: the server
// requires roll-ups (each schedule replaces the one before it on its
// subject) and refuses DiscardNew. Without MaxBytes or MaxMsgs nothing is
// ever discarded, so DiscardOld changes nothing; with them, schedules stay
// off, since a full stream would drop its oldest jobs. With MaxAge, the
// stream allows per-message TTLs: schedules carry "Nats-TTL: never", so
// that a delayed job due later than MaxAge, or a periodic job's schedule
// older than it, is not aged out unfired.
func scheduleConfig(sc *jetstream.StreamConfig) bool {
	if sc.MaxBytes > 0 || sc.MaxMsgs > 0 {
		return false
	}
	sc.AllowMsgSchedules = true
	sc.AllowMsgTTL = sc.AllowMsgTTL || sc.MaxAge > 0
	sc.AllowRollup = true
	sc.DenyPurge = false
	sc.Discard = jetstream.DiscardOld
	return true
}

// enableSchedules turns message schedules on for an existing job stream
// that was provisioned without them, where it can: not on a stream with a
// size limit (see scheduleConfig), and not on a server before 2.12, which
// ignores the setting. Producers say why when a delayed job is enqueued.
func enableSchedules(ctx context.Context, js jetstream.JetStream, name string) error {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return fmt.Errorf("worker: look up stream %s: %w", name, err)
	}
	sc := s.CachedInfo().Config
	if sc.AllowMsgSchedules && (sc.MaxAge == 0 || sc.AllowMsgTTL) {
		return nil
	}
	if !scheduleConfig(&sc) {
		return fmt.Errorf("%w: job stream %s: %s", ErrNoSchedules, name, whyNoSchedules(sc))
	}
	if _, err := js.UpdateStream(ctx, sc); err != nil {
		return fmt.Errorf("worker: enable message schedules on stream %s: %w", name, err)
	}
	return nil
}

// jobIDOf is a job's ID: its Nats-Msg-Id; for a job the server's scheduler
// fired, which has none, the ID its schedule carries, and for a tick of a
// periodic job that ID and the tick's due time, the same for every repeat
// of the tick. Headers are untrusted: an ID that no header can carry is
// dropped.
func jobIDOf(h nats.Header) string {
	if id := h.Get(jetstream.MsgIDHeader); id != "" || len(headerValues(h, hdrScheduler)) == 0 {
		return id
	}
	id := firstValue(h, HeaderJobID)
	if next := firstValue(h, hdrScheduleNext); next != "" && next != "purge" {
		tick := "next=" + next
		if t, err := time.Parse(time.RFC3339Nano, next); err == nil {
			if every, err := time.ParseDuration(firstValue(h, HeaderEvery)); err == nil && every > 0 {
				tick = t.Add(-every).UTC().Format(time.RFC3339)
			}
		}
		id += "@" + tick
	}
	if validID(id) != nil {
		return ""
	}
	return id
}

func firstValue(h nats.Header, key string) string {
	if vs := headerValues(h, key); len(vs) > 0 {
		return vs[0]
	}
	return ""
}

// Periodic is a job enqueued on a schedule: every Every, or on the cron
// schedule Cron. Declare periodic jobs in code and register them at start
// with Producer.Schedule from every process that wants them: registering
// the same definition again changes nothing, so the schedule and its
// timing survive restarts and rolling deploys, and the server fires each
// tick once for the whole fleet.
type Periodic struct {
	// Name identifies the periodic job in the job stream. Default: Kind.
	Name string
	// Kind is the job's kind (see Mux). Required.
	Kind string
	// Every is the interval between ticks, at least a second. The server
	// fires a tick an interval after the previous one, and after a pause
	// (a server down) fires once and goes on, without catching up.
	Every time.Duration
	// Cron is a cron schedule instead: six fields (seconds first) or
	// @hourly, @daily, @weekly, @monthly, @yearly. It needs nats-server
	// 2.14 or later. Exactly one of Every and Cron is set.
	Cron string
	// TimeZone is an IANA zone name for Cron. Default UTC.
	TimeZone string
	// Payload is each tick's payload, encoded with Codec. Default nil,
	// which JSONCodec encodes as null: a JSON handler sees T's zero value.
	Payload any
	// Codec encodes Payload. Default JSONCodec.
	Codec Codec
	// Key picks the ticks' partition. Default: Name.
	Key []byte
}

func (pj *Periodic) setDefaults() {
	if pj.Name == "" {
		pj.Name = pj.Kind
	}
	if pj.Codec == nil {
		pj.Codec = JSONCodec
	}
	if pj.Key == nil {
		pj.Key = []byte(pj.Name)
	}
}

// Validate reports every problem with pj at once.
func (pj Periodic) Validate() error {
	pj.setDefaults()
	var errs []error
	if err := ValidKind(pj.Kind); err != nil {
		errs = append(errs, err)
	}
	if err := validID("periodic/" + pj.Name); err != nil {
		errs = append(errs, err)
	}
	switch {
	case (pj.Every != 0) == (pj.Cron != ""):
		errs = append(errs, fmt.Errorf("periodic job %q: set exactly one of Every and Cron", pj.Name))
	case pj.Cron == "" && pj.Every < time.Second:
		errs = append(errs, fmt.Errorf("periodic job %q: Every %v is below the server's minimum of a second", pj.Name, pj.Every))
	case pj.TimeZone != "" && pj.Cron == "":
		errs = append(errs, fmt.Errorf("periodic job %q: TimeZone applies to Cron only", pj.Name))
	}
	return errors.Join(errs...)
}

// Schedule registers periodic jobs, idempotently: a job whose schedule is
// stored with the same definition is left alone (its next tick stays
// where it is), a changed one replaces the old schedule, and concurrent
// registrations by many processes store one schedule. It fails with an
// error matching ErrNoSchedules where the server or the job stream cannot
// schedule.
func (p *Producer) Schedule(ctx context.Context, jobs ...Periodic) error {
	for _, pj := range jobs {
		if err := pj.Validate(); err != nil {
			return fmt.Errorf("worker: schedule: %w", err)
		}
		pj.setDefaults()
		if err := p.check(ctx); err != nil {
			return err
		}
		if err := p.checkSchedules(ctx, pj.Cron != ""); err != nil {
			return err
		}
		if err := p.register(ctx, pj); err != nil {
			return fmt.Errorf("worker: schedule periodic job %q: %w", pj.Name, err)
		}
	}
	return nil
}

// Unschedule removes the periodic job name; ticks already fired stay.
func (p *Producer) Unschedule(ctx context.Context, name string) error {
	s, err := p.js.Stream(ctx, JobsStream(p.cfg.Prefix))
	if err != nil {
		return fmt.Errorf("worker: unschedule %q: %w", name, err)
	}
	if err := s.Purge(ctx, jetstream.WithPurgeSubject(PeriodicSubject(p.cfg.Prefix, name))); err != nil {
		return fmt.Errorf("worker: unschedule %q: %w", name, err)
	}
	return nil
}

func (p *Producer) register(ctx context.Context, pj Periodic) error {
	data, err := pj.Codec.Marshal(pj.Payload)
	if err != nil {
		return fmt.Errorf("encode the payload: %w", err)
	}
	part := leasehold.PartitionFor(pj.Key, p.cfg.Partitions)
	subject := PeriodicSubject(p.cfg.Prefix, pj.Name)
	msg := &nats.Msg{Subject: subject, Data: data, Header: nats.Header{}}
	if pj.Cron != "" {
		msg.Header.Set(hdrSchedule, pj.Cron)
		if pj.TimeZone != "" {
			msg.Header.Set(hdrScheduleTZ, pj.TimeZone)
		}
	} else {
		msg.Header.Set(hdrSchedule, "@every "+pj.Every.String())
		msg.Header.Set(HeaderEvery, pj.Every.String())
	}
	msg.Header.Set(hdrScheduleTarget, JobSubject(p.cfg.Prefix, part))
	msg.Header.Set(leasehold.HeaderOrderKey, leasehold.OrderKey(pj.Key))
	msg.Header.Set(HeaderKind, pj.Kind)
	msg.Header.Set(HeaderPeriodic, pj.Name)
	msg.Header.Set(HeaderJobID, "periodic/"+pj.Name)
	p.neverExpire(msg.Header)

	s, err := p.js.Stream(ctx, JobsStream(p.cfg.Prefix))
	if err != nil {
		return err
	}
	for attempt := 0; ; attempt++ {
		var last uint64
		stored, err := s.GetLastMsgForSubject(ctx, subject)
		switch {
		case err == nil:
			if sameSchedule(stored, msg) {
				return nil
			}
			last = stored.Sequence
		case errors.Is(err, jetstream.ErrMsgNotFound):
		default:
			return fmt.Errorf("read the stored schedule: %w", err)
		}
		actx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
		_, err = p.js.PublishMsg(actx, msg, jetstream.WithExpectLastSequencePerSubject(last))
		cancel()
		if err == nil {
			return nil
		}
		var apiErr *jetstream.APIError
		raced := errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
			apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
		if !raced && !transientPublish(err) || attempt >= p.cfg.Retries || ctx.Err() != nil {
			return fmt.Errorf("store the schedule: %w", err)
		}
		// Another process registered meanwhile, or the outcome is
		// unknown: read what is stored and decide again.
		if err := sleep(ctx, p.retryWait(attempt+1)); err != nil {
			return err
		}
	}
}

// sameSchedule reports whether the stored schedule is msg's definition.
func sameSchedule(stored *jetstream.RawStreamMsg, msg *nats.Msg) bool {
	if !bytes.Equal(stored.Data, msg.Data) {
		return false
	}
	for _, k := range []string{hdrSchedule, hdrScheduleTZ, hdrScheduleTarget, HeaderKind, HeaderPeriodic, HeaderEvery, HeaderJobID, hdrTTL, leasehold.HeaderOrderKey} {
		if stored.Header.Get(k) != msg.Header.Get(k) {
			return false
		}
	}
	return true
}
