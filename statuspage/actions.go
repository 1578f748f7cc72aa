package statuspage

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/statuspage/deadletter"
	"github.com/leasehold/leasehold/worker"
)

// ActionsConfig turns on the page's actions: replay or purge a dead
// letter, cancel a job. They are off unless Token or IdentityHeader is
// set.
//
// A browser signs in with the token (POST /actions/login), which gives it
// a session cookie (HttpOnly, SameSite=Strict) and a CSRF token the page
// sends with each action; a program sends the token itself, as
// "Authorization: Bearer <token>". Every action is a POST with a JSON body
// from the page's own origin (Origin, else Referer), is logged, and is
// published as an event that every status page shows: who, what, result.
type ActionsConfig struct {
	// Token is the secret that allows actions. Read it from a file or the
	// environment, never from a command line that ps shows.
	Token string
	// IdentityHeader names the header a reverse proxy in front of the page
	// sets to the user it authenticated, such as X-Forwarded-User. It is
	// trusted only when named here, and then required: a request without
	// it takes no action. The proxy must strip it from what clients send.
	// With Token too, both are required.
	IdentityHeader string
	// Origins are the origins the page is opened at besides its own host
	// (scheme://host[:port]), for a proxy that rewrites Host.
	Origins []string
	// SessionTTL is how long a browser's sign-in lasts. Default 12h.
	SessionTTL time.Duration
}

// Enabled reports whether the page takes actions.
func (a ActionsConfig) Enabled() bool { return a.Token != "" || a.IdentityHeader != "" }

// Actions a page takes, as events name them.
const (
	ActionReplay = "dlq replay"
	ActionPurge  = "dlq purge"
	ActionCancel = "jobs cancel"
)

// sessionCookie is the cookie of a signed-in browser.
const sessionCookie = "leasehold_actions"

// maxSessions bounds the signed-in browsers one page remembers; the
// oldest sign-in goes first.
const maxSessions = 256

// actionTimeout bounds one action.
const actionTimeout = 20 * time.Second

type session struct {
	who     string
	csrf    string
	expires time.Time
}

// actions serves the page's actions.
type actions struct {
	s   *Server
	cfg ActionsConfig

	mu       sync.Mutex
	sessions map[string]*session

	pmu      sync.Mutex
	producer *worker.Producer // for cancel, once made
}

func newActions(s *Server, cfg ActionsConfig) *actions {
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = 12 * time.Hour
	}
	return &actions{s: s, cfg: cfg, sessions: map[string]*session{}}
}

func (a *actions) register(mux *http.ServeMux) {
	mux.HandleFunc("GET /actions/session", a.session)
	mux.HandleFunc("POST /actions/login", a.login)
	mux.HandleFunc("POST /actions/logout", a.logout)
	mux.HandleFunc("POST /actions/dlq/replay", a.act(ActionReplay))
	mux.HandleFunc("POST /actions/dlq/purge", a.act(ActionPurge))
	mux.HandleFunc("POST /actions/jobs/cancel", a.act(ActionCancel))
}

// fail answers an action request that was refused, and logs it.
func (a *actions) fail(w http.ResponseWriter, r *http.Request, code int, msg string) {
	a.s.cfg.Logger.Warn("status page: action refused", "path", r.URL.Path, "remote", r.RemoteAddr, "status", code, "why", msg)
	if code == http.StatusUnauthorized {
		w.Header().Set("WWW-Authenticate", `Bearer realm="leasehold status page actions"`)
	}
	reply(w, code, map[string]any{"ok": false, "error": msg})
}

func reply(w http.ResponseWriter, code int, v any) {
	secure(w, "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// sameOrigin checks that a browser sent r from the page's own origin: its
// Origin header, or without one its Referer, names the request's host (or
// one of ActionsConfig.Origins). A request with neither passes only when
// bearer is set: a program's, which carries the token itself and no
// cookie a browser would add on its own.
func (a *actions) sameOrigin(r *http.Request, bearer bool) error {
	origin := r.Header.Get("Origin")
	if origin == "" {
		if ref := r.Header.Get("Referer"); ref != "" {
			u, err := url.Parse(ref)
			if err != nil {
				return errors.New("cross-origin request refused: the Referer cannot be read")
			}
			origin = u.Scheme + "://" + u.Host
		}
	}
	if origin == "" {
		if bearer {
			return nil
		}
		return errors.New("cross-origin request refused: it has no Origin or Referer header")
	}
	if slices.Contains(a.cfg.Origins, origin) {
		return nil
	}
	u, err := url.Parse(origin)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || !strings.EqualFold(u.Host, r.Host) {
		return fmt.Errorf("cross-origin request refused: from %s, not from this page (%s); a proxy that rewrites Host needs ActionsConfig.Origins (--actions-origin)", clip(origin), clip(r.Host))
	}
	return nil
}

// identity is what the proxy's header says of the user, "" when it is
// not configured or not sent.
func (a *actions) identity(r *http.Request) (string, error) {
	if a.cfg.IdentityHeader == "" {
		return "", nil
	}
	who := strings.TrimSpace(r.Header.Get(a.cfg.IdentityHeader))
	if who == "" {
		return "", fmt.Errorf("no %s header: sign in through the proxy in front of this page", a.cfg.IdentityHeader)
	}
	if err := checkText(who); err != nil || len(who) > 128 {
		return "", fmt.Errorf("the %s header is no user name", a.cfg.IdentityHeader)
	}
	return who, nil
}

func (a *actions) tokenOK(token string) bool {
	return a.cfg.Token != "" && subtle.ConstantTimeCompare([]byte(token), []byte(a.cfg.Token)) == 1
}

// user is who sends r, with bearer set when r carries the token itself;
// or the status code and reason to refuse it.
func (a *actions) user(r *http.Request) (who string, sess *session, bearer bool, code int, err error) {
	ident, err := a.identity(r)
	if err != nil {
		return "", nil, false, http.StatusUnauthorized, err
	}
	if auth := r.Header.Get("Authorization"); auth != "" {
		token, ok := strings.CutPrefix(auth, "Bearer ")
		if !ok || !a.tokenOK(strings.TrimSpace(token)) {
			return "", nil, false, http.StatusUnauthorized, errors.New("the Authorization header does not carry the actions token")
		}
		if ident != "" {
			return ident, nil, true, 0, nil
		}
		return "token holder", nil, true, 0, nil
	}
	c, err := r.Cookie(sessionCookie)
	if err != nil {
		return "", nil, false, http.StatusUnauthorized, errors.New("not signed in: sign in on the page with the actions token, or send it as Authorization: Bearer <token>")
	}
	a.mu.Lock()
	s := a.sessions[c.Value]
	if s != nil && time.Now().After(s.expires) {
		delete(a.sessions, c.Value)
		s = nil
	}
	a.mu.Unlock()
	if s == nil {
		return "", nil, false, http.StatusUnauthorized, errors.New("the sign-in has expired or is unknown to this page: sign in again")
	}
	if ident != "" && ident != s.who {
		return "", nil, false, http.StatusUnauthorized, errors.New("the proxy's user is not the one who signed in: sign in again")
	}
	return s.who, s, false, 0, nil
}

// session says whether the page takes actions and who is signed in, with
// the CSRF token the page must send with each action. Another origin
// cannot read the answer.
func (a *actions) session(w http.ResponseWriter, r *http.Request) {
	out := map[string]any{"enabled": a.cfg.Enabled(), "token": a.cfg.Token != "", "proxy": a.cfg.IdentityHeader != ""}
	if a.cfg.Enabled() {
		if _, s, _, code, _ := a.user(r); code == 0 && s != nil {
			out["who"], out["csrf"] = s.who, s.csrf
		}
	}
	reply(w, http.StatusOK, out)
}

// decode reads a JSON request body of at most 4 KiB into v.
func decode(r *http.Request, v any) (int, error) {
	if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
		return http.StatusUnsupportedMediaType, errors.New("send the request as application/json")
	}
	dec := json.NewDecoder(io.LimitReader(r.Body, 4<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return http.StatusBadRequest, fmt.Errorf("the request body is no valid request: %v", err)
	}
	return 0, nil
}

func randomString() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}

// login signs a browser in: with the token (when one is configured) and
// the proxy's user (when its header is named), from the page's origin.
func (a *actions) login(w http.ResponseWriter, r *http.Request) {
	if !a.cfg.Enabled() {
		a.fail(w, r, http.StatusForbidden, errActionsOff)
		return
	}
	if err := a.sameOrigin(r, false); err != nil {
		a.fail(w, r, http.StatusForbidden, err.Error())
		return
	}
	var req struct {
		Token string `json:"token"`
		Name  string `json:"name"`
	}
	if code, err := decode(r, &req); err != nil {
		a.fail(w, r, code, err.Error())
		return
	}
	who, err := a.identity(r)
	if err != nil {
		a.fail(w, r, http.StatusUnauthorized, err.Error())
		return
	}
	if a.cfg.Token != "" && !a.tokenOK(req.Token) {
		a.fail(w, r, http.StatusUnauthorized, "wrong actions token")
		return
	}
	if who == "" {
		// The token says the user may act, not who they are: a name they
		// give is shown as theirs, marked as given.
		who = "token holder"
		if name := strings.TrimSpace(req.Name); name != "" {
			if checkText(name) != nil || len(name) > 64 {
				a.fail(w, r, http.StatusBadRequest, "the name must be printable text of at most 64 bytes")
				return
			}
			who = name + " (token)"
		}
	}
	s := &session{who: who, csrf: randomString(), expires: time.Now().Add(a.cfg.SessionTTL)}
	id := randomString()
	a.mu.Lock()
	now := time.Now()
	for k, old := range a.sessions {
		if now.After(old.expires) {
			delete(a.sessions, k)
		}
	}
	for len(a.sessions) >= maxSessions {
		var oldest string
		for k, old := range a.sessions {
			if oldest == "" || old.expires.Before(a.sessions[oldest].expires) {
				oldest = k
			}
		}
		delete(a.sessions, oldest)
	}
	a.sessions[id] = s
	a.mu.Unlock()
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: id, Path: "/", HttpOnly: true, Secure: r.TLS != nil,
		SameSite: http.SameSiteStrictMode, MaxAge: int(a.cfg.SessionTTL / time.Second)})
	a.s.cfg.Logger.Info("status page: signed in for actions", "who", who, "remote", r.RemoteAddr)
	reply(w, http.StatusOK, map[string]any{"ok": true, "who": who, "csrf": s.csrf})
}

// logout forgets the browser's sign-in.
func (a *actions) logout(w http.ResponseWriter, r *http.Request) {
	if err := a.sameOrigin(r, false); err != nil {
		a.fail(w, r, http.StatusForbidden, err.Error())
		return
	}
	if c, err := r.Cookie(sessionCookie); err == nil {
		a.mu.Lock()
		delete(a.sessions, c.Value)
		a.mu.Unlock()
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", Path: "/", HttpOnly: true, Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode, MaxAge: -1})
	reply(w, http.StatusOK, map[string]any{"ok": true})
}

const errActionsOff = "actions are off on this page: they need a token (ActionsConfig.Token; `leasehold status --actions-token-file`) or a proxy's identity header (ActionsConfig.IdentityHeader)"

// actionRequest is the body of an action: a dead letter (stream and
// sequence) or a job (ref).
type actionRequest struct {
	Stream string `json:"stream,omitempty"`
	Seq    uint64 `json:"seq,omitempty"`
	Ref    string `json:"ref,omitempty"`
}

// act serves one action: checked for origin, sign-in (or bearer token),
// CSRF token and input, then done, logged and published.
func (a *actions) act(name string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !a.cfg.Enabled() {
			a.fail(w, r, http.StatusForbidden, errActionsOff)
			return
		}
		bearer := r.Header.Get("Authorization") != ""
		if err := a.sameOrigin(r, bearer); err != nil {
			a.fail(w, r, http.StatusForbidden, err.Error())
			return
		}
		who, sess, _, code, err := a.user(r)
		if err != nil {
			a.fail(w, r, code, err.Error())
			return
		}
		if sess != nil {
			got := r.Header.Get("X-CSRF-Token")
			if got == "" || subtle.ConstantTimeCompare([]byte(got), []byte(sess.csrf)) != 1 {
				a.fail(w, r, http.StatusForbidden, "missing or wrong CSRF token (X-CSRF-Token): reload the page")
				return
			}
		}
		var req actionRequest
		if code, err := decode(r, &req); err != nil {
			a.fail(w, r, code, err.Error())
			return
		}
		target, run, err := a.plan(name, req)
		if err != nil {
			a.fail(w, r, http.StatusBadRequest, err.Error())
			return
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
		defer cancel()
		result, err := run(ctx)
		ev := Event{Kind: KindAction, Actor: who, Action: name, Target: target, Result: result}
		if err != nil {
			ev.Failed, ev.Result = true, oneLine(err.Error())
			a.s.cfg.Logger.Warn("status page: action failed", "who", who, "action", name, "target", target, "remote", r.RemoteAddr, "err", err)
		} else {
			a.s.cfg.Logger.Info("status page: action done", "who", who, "action", name, "target", target, "remote", r.RemoteAddr, "result", result)
		}
		if a.s.cfg.Events != nil {
			a.s.cfg.Events.Publish(ev)
		}
		if err != nil {
			reply(w, http.StatusConflict, map[string]any{"ok": false, "error": err.Error()})
			return
		}
		reply(w, http.StatusOK, map[string]any{"ok": true, "result": result})
	}
}

// plan checks an action's input and returns what it acts on and how.
func (a *actions) plan(name string, req actionRequest) (string, func(context.Context) (string, error), error) {
	switch name {
	case ActionCancel:
		if req.Stream != "" || req.Seq != 0 {
			return "", nil, errors.New("a cancel takes a job reference (ref), no dead letter")
		}
		ref, err := worker.ParseRef(req.Ref)
		if err != nil {
			return "", nil, err
		}
		return "job " + ref.Ref(), func(ctx context.Context) (string, error) { return a.cancel(ctx, ref) }, nil
	default:
		if req.Ref != "" {
			return "", nil, errors.New("a dead letter is named by stream and seq, not by a job reference")
		}
		d, ok := a.deadLetterStream(req.Stream)
		if !ok {
			return "", nil, fmt.Errorf("%s is no dead-letter stream this page shows", clip(req.Stream))
		}
		if req.Seq == 0 {
			return "", nil, errors.New("no sequence (seq) of a dead letter")
		}
		target := d.Stream + " " + strconv.FormatUint(req.Seq, 10)
		return target, func(ctx context.Context) (string, error) { return a.deadLetter(ctx, name, d, req.Seq) }, nil
	}
}

func (a *actions) deadLetterStream(name string) (DeadLetterStream, bool) {
	for _, d := range a.s.cfg.DeadLetters {
		if d.Stream == name && name != "" {
			return d, true
		}
	}
	return DeadLetterStream{}, false
}

// deadLetter replays or purges one dead letter as `leasehold dlq replay`
// and `purge` (with --sink for a sink's) do.
func (a *actions) deadLetter(ctx context.Context, name string, d DeadLetterStream, seq uint64) (string, error) {
	js := a.s.cfg.JetStream
	st, err := js.Stream(ctx, d.Stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return "", fmt.Errorf("dead-letter stream %s does not exist", d.Stream)
	}
	if err != nil {
		return "", fmt.Errorf("look up dead-letter stream %s: %w", d.Stream, err)
	}
	dl := deadletter.New(js, st, a.s.cfg.Prefix, d.Sink, d.Log)
	defer a.s.Poke()
	if name == ActionPurge {
		if err := dl.Purge(ctx, seq); err != nil {
			return "", err
		}
		return "purged", nil
	}
	m, err := dl.Get(ctx, seq)
	if err != nil {
		return "", err
	}
	r, err := dl.Replay(ctx, m)
	if err != nil {
		return "", err
	}
	res := fmt.Sprintf("replayed to %s (%s sequence %d)", r.Subject, r.Stream, r.Seq)
	if r.As != "" {
		res = "replayed as " + r.As
	}
	if r.Duplicate {
		res += ", stored by an earlier replay"
	}
	return res, nil
}

// cancel cancels a job as `leasehold jobs cancel` does.
func (a *actions) cancel(ctx context.Context, ref worker.Enqueued) (string, error) {
	p, err := a.jobProducer(ctx)
	if err != nil {
		return "", err
	}
	st, err := p.Cancel(ctx, ref)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("cancel stored (the job was %s)", st.State), nil
}

// jobProducer makes, once, the producer cancels go through, with the job
// stream's partition count as recorded on it.
func (a *actions) jobProducer(ctx context.Context) (*worker.Producer, error) {
	a.pmu.Lock()
	defer a.pmu.Unlock()
	if a.producer != nil {
		return a.producer, nil
	}
	stream := worker.JobsStream(a.s.cfg.Prefix)
	s, err := a.s.cfg.JetStream.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("look up the job stream %s: %w", stream, err)
	}
	n, err := strconv.Atoi(s.CachedInfo().Config.Metadata["leasehold.partitions"])
	if err != nil || n < 1 {
		return nil, fmt.Errorf("the job stream %s does not record its partition count: was it made by `leasehold init`?", stream)
	}
	p, err := worker.NewProducer(a.s.cfg.JetStream, worker.ProducerConfig{Prefix: a.s.cfg.Prefix, Partitions: n, Bucket: a.s.cfg.Bucket})
	if err != nil {
		return nil, err
	}
	a.producer = p
	return p, nil
}
