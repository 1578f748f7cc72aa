package statuspage

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/headless"
	"github.com/leasehold/leasehold/testing/natstest"
	"github.com/leasehold/leasehold/worker"
)

const testToken = "s3cret-actions-token-0123456789"

// logSink keeps the messages and attributes a page logs, for the test to
// see what it refused and why.
type logSink struct {
	mu    sync.Mutex
	lines []string
}

func (l *logSink) Enabled(context.Context, slog.Level) bool { return true }
func (l *logSink) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
	l.mu.Lock()
	l.lines = append(l.lines, b.String())
	l.mu.Unlock()
	return nil
}
func (l *logSink) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logSink) WithGroup(string) slog.Handler      { return l }

func (l *logSink) has(parts ...string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			return true
		}
	}
	return false
}

// actionsEnv is a job stream under "shop" with jobs, their dead letters
// and a status page serving actions.
type actionsEnv struct {
	js       jetstream.JetStream
	producer *worker.Producer
	page     *Page
	logs     *logSink
}

func newActionsEnv(t *testing.T, ctx context.Context, actions ActionsConfig) *actionsEnv {
	t.Helper()
	js := natstest.Start(t).JetStream(t)
	if err := worker.ProvisionJobs(ctx, js, worker.JobsConfig{Prefix: "shop", Partitions: 2}); err != nil {
		t.Fatal(err)
	}
	b, err := coordinator.Provision(ctx, js, coordinator.BucketConfig{Bucket: "shop-leases", Scope: "shop"})
	if err != nil {
		t.Fatal(err)
	}
	producer, err := worker.NewProducer(js, worker.ProducerConfig{Prefix: "shop", Partitions: 2, Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	logs := &logSink{}
	page, err := Serve(ctx, ServeConfig{JetStream: js, Bucket: b, Prefix: "shop", Name: "page-1", Addr: "127.0.0.1:0",
		Actions: actions, Logger: slog.New(logs), DeadLetters: DefaultDeadLetters("shop", true, true)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(page.Close)
	// A worker whose handler fails every job that asks it to, once, and
	// holds a job that asks it to until the job is cancelled.
	w, err := worker.New(worker.Config{JetStream: js, Prefix: "shop", Partitions: 2, Bucket: b, MaxAttempts: 1,
		Coordinator: coordinator.Config{Worker: "worker-1", TTL: 2 * time.Second}, Logger: slog.New(slog.DiscardHandler),
		Handler: worker.HandlerFunc(func(ctx context.Context, j *worker.Job) error {
			switch {
			case bytes.Contains(j.Data, []byte("fail")):
				return errors.New("card declined")
			case bytes.Contains(j.Data, []byte("hold")):
				<-ctx.Done()
				return context.Cause(ctx)
			}
			return nil
		})})
	if err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); _ = w.Run(wctx) }()
	t.Cleanup(func() { stop(); <-ran })
	return &actionsEnv{js: js, producer: producer, page: page, logs: logs}
}

// deadJob enqueues a job that fails, and waits until the worker has
// dead-lettered it; it returns the job and its dead letter's sequence.
func (e *actionsEnv) deadJob(t *testing.T, ctx context.Context, key string) (worker.Enqueued, uint64) {
	t.Helper()
	job, err := e.producer.Enqueue(ctx, []byte(key), []byte(`{"order":"`+key+`","fail":true}`))
	if err != nil {
		t.Fatal(err)
	}
	sts, err := e.producer.Wait(ctx, job)
	if err != nil || sts[0].State != worker.JobDeadLettered {
		t.Fatalf("job %s: %v (%v), want dead-lettered", job.Ref(), sts, err)
	}
	dlq, err := e.js.Stream(ctx, worker.DLQStream("shop"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := dlq.GetLastMsgForSubject(ctx, worker.DLQSubject("shop", job.Partition))
	if err != nil || m.Header.Get(worker.HeaderSeq) != fmt.Sprint(job.Seq) {
		t.Fatalf("the dead letter of job %s: %v %v", job.Ref(), m, err)
	}
	return job, m.Sequence
}

// post sends an action as a program would: JSON, with the headers given.
func post(t *testing.T, url string, body any, header http.Header) (int, string) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, vs := range header {
		req.Header[k] = vs
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(out)
}

func (e *actionsEnv) status(t *testing.T, ctx context.Context, job worker.Enqueued) worker.JobStatus {
	t.Helper()
	st, err := e.producer.Status(ctx, job)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// The page's actions in a real headless Chromium: refused before the
// sign-in and with a wrong token, and from another origin even with the
// browser signed in; a GET does nothing; signed in, a dead letter is
// replayed (as `leasehold dlq replay` does it: the job's status says
// "replayed as <ref>" and the replay keeps the job's origin, so its keys),
// another purged, a job cancelled, and each shows as an event on the page
// with who did it and how it went.
func TestActionsInChromium(t *testing.T) {
	t.Parallel()
	headless.Path(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	e := newActionsEnv(t, ctx, ActionsConfig{Token: testToken})
	replayJob, replaySeq := e.deadJob(t, ctx, "o-1")
	purgeJob, purgeSeq := e.deadJob(t, ctx, "o-2")
	getJob, getSeq := e.deadJob(t, ctx, "o-3")
	waiting, err := e.producer.Enqueue(ctx, []byte("o-4"), []byte(`{"order":"o-4","hold":true}`))
	if err != nil {
		t.Fatal(err)
	}

	b := headless.Start(t, ctx, e.page.URL())
	b.WaitFor(t, ctx, "the dead letters", `document.querySelectorAll("#dead-letters table[data-stream='shop-dlq'] tbody tr").length === 3`)
	b.WaitFor(t, ctx, "the sign-in form", `!document.getElementById("sign-in").hidden && document.getElementById("signed-in").hidden`)
	// Not signed in: no buttons, and the actions themselves refuse.
	var n int
	if err := b.Eval(ctx, `document.querySelectorAll("#dead-letters button").length`, &n); err != nil || n != 0 {
		t.Fatalf("%d action buttons before the sign-in (%v)", n, err)
	}
	var code int
	if err := b.Await(ctx, fmt.Sprintf(`fetch("actions/dlq/replay", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify({stream: "shop-dlq", seq: %d})}).then(r => r.status)`, replaySeq), &code); err != nil || code != http.StatusUnauthorized {
		t.Fatalf("a replay before the sign-in: %d (%v), want 401", code, err)
	}
	// A wrong token signs nobody in.
	signIn := func(token string) string {
		t.Helper()
		var msg string
		if err := b.Await(ctx, fmt.Sprintf(`new Promise(done => {
			document.addEventListener("leasehold:session", () => done(document.getElementById("action-msg").textContent), {once: true});
			document.getElementById("token").value = %q;
			document.getElementById("actor-name").value = "ana";
			document.getElementById("sign-in-button").click();
		})`, token), &msg); err != nil {
			t.Fatal(err)
		}
		return msg
	}
	if msg := signIn("not-the-token-at-all"); !strings.Contains(msg, "401") || !strings.Contains(msg, "wrong actions token") {
		t.Fatalf("a wrong token: the page says %q, want a 401", msg)
	}
	if msg := signIn(testToken); msg != "signed in as ana (token)" {
		t.Fatalf("the token: the page says %q", msg)
	}
	b.WaitFor(t, ctx, "replay and purge buttons on each dead letter", `document.querySelectorAll("#dead-letters table[data-stream='shop-dlq'] button[data-action]").length === 6`)

	// A GET does nothing, signed in or not.
	for _, path := range []string{"dlq/replay", "dlq/purge", "jobs/cancel"} {
		if err := b.Await(ctx, fmt.Sprintf(`fetch("actions/%s?stream=shop-dlq&seq=%d&ref=%s", {credentials: "same-origin"}).then(r => r.status)`, path, getSeq, waiting.Ref()), &code); err != nil || code != http.StatusMethodNotAllowed {
			t.Fatalf("GET actions/%s: %d (%v), want 405", path, code, err)
		}
	}

	// Another origin (another port of the same host: the same site, so
	// the browser sends the SameSite cookie of its sign-in) posts to the
	// page: refused for its origin.
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		_, _ = io.WriteString(w, "<!doctype html><title>elsewhere</title>")
	}))
	defer evil.Close()
	if err := b.Eval(ctx, fmt.Sprintf(`location.href = %q, true`, evil.URL), new(bool)); err != nil {
		t.Fatal(err)
	}
	b.WaitFor(t, ctx, "the other origin's page", `document.title === "elsewhere"`)
	var sent int
	if err := b.Await(ctx, fmt.Sprintf(`fetch(%q, {method: "POST", mode: "no-cors", credentials: "include", body: JSON.stringify({stream: "shop-dlq", seq: %d})}).then(() => 1, () => 0)`,
		e.page.URL()+"actions/dlq/replay", getSeq), &sent); err != nil || sent != 1 {
		t.Fatalf("the other origin's POST was not sent (%d, %v)", sent, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !e.logs.has("action refused", "cross-origin request refused", "/actions/dlq/replay", "from \""+evil.URL+"\"") {
		if time.Now().After(deadline) {
			t.Fatalf("the other origin's POST was not refused for its origin; the page logged %q", e.logs.lines)
		}
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Eval(ctx, fmt.Sprintf(`location.href = %q, true`, e.page.URL()), new(bool)); err != nil {
		t.Fatal(err)
	}
	b.WaitFor(t, ctx, "the page again, still signed in", `document.title === "leasehold status" && !document.getElementById("signed-in").hidden && document.getElementById("actor").textContent === "ana (token)" &&
		document.querySelectorAll("#dead-letters table[data-stream='shop-dlq'] button[data-action]").length === 6`)

	// Signed in, on the page: replay.
	act := func(what, js string) string {
		t.Helper()
		var msg string
		if err := b.Await(ctx, `new Promise(done => {
			document.addEventListener("leasehold:action", () => done(document.getElementById("action-msg").textContent), {once: true});
			`+js+`
		})`, &msg); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return msg
	}
	msg := act("replay", fmt.Sprintf(`document.querySelector("#dead-letters button[data-action='replay'][data-seq='%d']").click();`, replaySeq))
	st := e.status(t, ctx, replayJob)
	if st.State != worker.JobReplayed || st.ReplayedAs == "" || !strings.Contains(msg, "replayed as "+st.ReplayedAs) {
		t.Fatalf("replay: the page says %q; the job is %s (replayed as %q)", msg, st.State, st.ReplayedAs)
	}
	as, err := worker.ParseRef(st.ReplayedAs)
	if err != nil {
		t.Fatal(err)
	}
	jobs, err := e.js.Stream(ctx, worker.JobsStream("shop"))
	if err != nil {
		t.Fatal(err)
	}
	replayed, err := jobs.GetMsg(ctx, as.Seq)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := replayed.Header.Get(leasehold.HeaderOrigin), leasehold.OriginOf("shop", replayJob.Partition, replayJob.Seq).String(); got != want {
		t.Fatalf("the replay's origin is %q, want the job's %q: its effects would not keep their keys", got, want)
	}
	// Purge: a second click confirms.
	b.WaitFor(t, ctx, "the replayed dead letter gone", fmt.Sprintf(`!document.querySelector("#dead-letters button[data-seq='%d']")`, replaySeq))
	if err := b.Eval(ctx, fmt.Sprintf(`document.querySelector("#dead-letters button[data-action='purge'][data-seq='%d']").click(), true`, purgeSeq), new(bool)); err != nil {
		t.Fatal(err)
	}
	b.WaitFor(t, ctx, "the purge asking to be confirmed", fmt.Sprintf(`document.querySelector("#dead-letters button[data-action='purge'][data-seq='%d']").textContent === "confirm purge"`, purgeSeq))
	if st := e.status(t, ctx, purgeJob); st.State != worker.JobDeadLettered {
		t.Fatalf("the purge ran before its confirmation: %s", st.State)
	}
	msg = act("purge", fmt.Sprintf(`document.querySelector("#dead-letters button[data-action='purge'][data-seq='%d']").click();`, purgeSeq))
	if st := e.status(t, ctx, purgeJob); st.State != worker.JobPurged || !strings.Contains(msg, "purged") {
		t.Fatalf("purge: the page says %q; the job is %s", msg, st.State)
	}
	// Cancel.
	msg = act("cancel", fmt.Sprintf(`document.getElementById("cancel-ref").value = %q; document.getElementById("cancel-button").click();`, waiting.Ref()))
	if !strings.Contains(msg, "cancel stored") {
		t.Fatalf("cancel: the page says %q", msg)
	}
	if sts, err := e.producer.Wait(ctx, waiting); err != nil || sts[0].State != worker.JobCancelled {
		t.Fatalf("the cancelled job ended %v (%v), want cancelled", sts, err)
	}
	// A cancel that fails says why, as `leasehold jobs cancel` does.
	msg = act("cancel of a finished job", fmt.Sprintf(`document.getElementById("cancel-ref").value = %q; document.getElementById("cancel-button").click();`, purgeJob.Ref()))
	if !strings.Contains(msg, "409") || !strings.Contains(msg, "nothing to cancel") {
		t.Fatalf("cancel of a purged job: the page says %q", msg)
	}

	// Each shows as an event, with who did what and how it went; the one
	// the GET named is still there.
	b.WaitFor(t, ctx, "the four actions as events", fmt.Sprintf(`(() => {
		const rows = Array.from(document.querySelectorAll("#actions tr")).map(tr => Array.from(tr.cells).map(c => c.textContent));
		const has = (action, target, result, cls) => Array.from(document.querySelectorAll("#actions tr."+cls)).some(tr =>
			tr.cells[1].textContent === "ana (token)" && tr.cells[2].textContent === action && tr.cells[3].textContent === target && tr.cells[4].textContent.includes(result) && tr.cells[5].textContent === "page-1");
		return has("dlq replay", "shop-dlq %d", "replayed as %s", "done") && has("dlq purge", "shop-dlq %d", "purged", "done") &&
			has("jobs cancel", "job %s", "cancel stored", "done") && has("jobs cancel", "job %s", "nothing to cancel", "failed") && rows.length === 4;
	})()`, replaySeq, st.ReplayedAs, purgeSeq, waiting.Ref(), purgeJob.Ref()))
	if st := e.status(t, ctx, getJob); st.State != worker.JobDeadLettered {
		t.Fatalf("the job whose dead letter a GET and another origin named is %s, want still dead-lettered", st.State)
	}
	if !e.logs.has("action done", "who=ana (token)", "action=dlq replay") {
		t.Errorf("the replay is not in the log: %q", e.logs.lines)
	}
}

// The actions over HTTP, as a program or an attacker sends them: off
// unless configured; 401 without the token, 403 from another origin or
// without the CSRF token, 400 for bad input, 415 for what is not JSON; a
// program's bearer token replays a stream sink's dead letter as `leasehold
// dlq replay --sink` does; and a proxy's user is trusted only in the
// header the page names.
func TestActionsOverHTTP(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	off := newActionsEnv(t, ctx, ActionsConfig{})
	_, offSeq := off.deadJob(t, ctx, "o-1")
	origin := strings.TrimSuffix(off.page.URL(), "/")
	if code, body := post(t, off.page.URL()+"actions/dlq/purge", map[string]any{"stream": "shop-dlq", "seq": offSeq},
		http.Header{"Origin": {origin}, "Authorization": {"Bearer " + testToken}}); code != http.StatusForbidden || !strings.Contains(body, "actions are off") {
		t.Fatalf("actions off: %d %s", code, body)
	}
	if _, body := get(t, off.page.URL()+"actions/session"); !strings.Contains(body, `"enabled":false`) {
		t.Fatalf("actions off: the session says %s", body)
	}

	e := newActionsEnv(t, ctx, ActionsConfig{Token: testToken})
	url := e.page.URL()
	origin = strings.TrimSuffix(url, "/")
	_, seq := e.deadJob(t, ctx, "o-2")
	bearer := http.Header{"Authorization": {"Bearer " + testToken}}
	for name, c := range map[string]struct {
		path   string
		body   any
		header http.Header
		code   int
		says   string
	}{
		"no token":         {"dlq/replay", map[string]any{"stream": "shop-dlq", "seq": seq}, http.Header{"Origin": {origin}}, 401, "not signed in"},
		"a wrong token":    {"dlq/replay", map[string]any{"stream": "shop-dlq", "seq": seq}, http.Header{"Authorization": {"Bearer " + testToken + "x"}}, 401, "does not carry the actions token"},
		"no origin":        {"dlq/purge", map[string]any{"stream": "shop-dlq", "seq": seq}, http.Header{}, 403, "no Origin or Referer"},
		"another origin":   {"dlq/purge", map[string]any{"stream": "shop-dlq", "seq": seq}, http.Header{"Origin": {"http://evil.example"}, "Authorization": bearer["Authorization"]}, 403, "cross-origin request refused"},
		"another referer":  {"dlq/purge", map[string]any{"stream": "shop-dlq", "seq": seq}, http.Header{"Referer": {"http://evil.example/x"}, "Authorization": bearer["Authorization"]}, 403, "cross-origin request refused"},
		"no sequence":      {"dlq/replay", map[string]any{"stream": "shop-dlq"}, bearer, 400, "no sequence"},
		"another stream":   {"dlq/replay", map[string]any{"stream": "shop-jobs", "seq": 1}, bearer, 400, "no dead-letter stream this page shows"},
		"a bad reference":  {"jobs/cancel", map[string]any{"ref": "seven"}, bearer, 400, "job reference"},
		"an unknown field": {"jobs/cancel", map[string]any{"ref": "0:1", "force": true}, bearer, 400, "unknown field"},
		"no dead letter":   {"dlq/replay", map[string]any{"stream": "shop-dlq", "seq": seq + 1000}, bearer, 409, "no dead letter at sequence"},
	} {
		if code, body := post(t, url+"actions/"+c.path, c.body, c.header); code != c.code || !strings.Contains(body, c.says) {
			t.Errorf("%s: %d %s, want %d saying %q", name, code, body, c.code, c.says)
		}
	}
	req, _ := http.NewRequest(http.MethodPost, url+"actions/dlq/purge", strings.NewReader(fmt.Sprintf("stream=shop-dlq&seq=%d", seq)))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Authorization", "Bearer "+testToken)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusUnsupportedMediaType {
		t.Fatalf("a form: %v %v, want 415", resp, err)
	} else {
		resp.Body.Close()
	}

	// A browser's session: the cookie alone is not enough.
	code, body := post(t, url+"actions/login", map[string]any{"token": testToken}, http.Header{"Origin": {origin}})
	var login struct{ Who, CSRF string }
	if err := json.Unmarshal([]byte(body), &login); code != 200 || err != nil || login.CSRF == "" {
		t.Fatalf("login: %d %s", code, body)
	}
	var cookie string
	if resp, err := http.Post(url+"actions/login", "application/json", strings.NewReader(`{"token":"`+testToken+`"}`)); err == nil {
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("a login without Origin: %d, want 403", resp.StatusCode)
		}
	}
	{
		req, _ := http.NewRequest(http.MethodPost, url+"actions/login", strings.NewReader(`{"token":"`+testToken+`"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Origin", origin)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		c := resp.Cookies()
		if len(c) != 1 || !c[0].HttpOnly || c[0].SameSite != http.SameSiteStrictMode {
			t.Fatalf("the session cookie: %+v", c)
		}
		cookie = c[0].Name + "=" + c[0].Value
	}
	_, sessBody := get(t, url+"actions/session")
	if strings.Contains(sessBody, "csrf") {
		t.Fatalf("the session without the cookie hands out a CSRF token: %s", sessBody)
	}
	sreq, _ := http.NewRequest(http.MethodGet, url+"actions/session", nil)
	sreq.Header.Set("Cookie", cookie)
	sresp, err := http.DefaultClient.Do(sreq)
	if err != nil {
		t.Fatal(err)
	}
	var sess struct{ Who, CSRF string }
	_ = json.NewDecoder(sresp.Body).Decode(&sess)
	sresp.Body.Close()
	if sess.CSRF == "" || sess.Who != "token holder" {
		t.Fatalf("the session: %+v", sess)
	}
	withCookie := func(h http.Header) http.Header { h.Set("Cookie", cookie); return h }
	target := map[string]any{"stream": "shop-dlq", "seq": seq}
	if code, body := post(t, url+"actions/dlq/purge", target, withCookie(http.Header{"Origin": {origin}})); code != 403 || !strings.Contains(body, "CSRF") {
		t.Errorf("the cookie without the CSRF token: %d %s", code, body)
	}
	if code, body := post(t, url+"actions/dlq/purge", target, withCookie(http.Header{"Origin": {"http://evil.example"}, "X-Csrf-Token": {sess.CSRF}})); code != 403 || !strings.Contains(body, "cross-origin") {
		t.Errorf("the cookie and CSRF token from another origin: %d %s", code, body)
	}
	if code, body := post(t, url+"actions/dlq/purge", target, withCookie(http.Header{"Origin": {origin}, "X-Csrf-Token": {sess.CSRF}})); code != 200 || !strings.Contains(body, "purged") {
		t.Fatalf("the cookie and CSRF token from the page: %d %s", code, body)
	}

	// A stream sink's dead letter, replayed by a program with the token:
	// back to the effect log with its stamp alone, as `leasehold dlq replay
	// --sink` sends it.
	if _, err := e.js.CreateStream(ctx, jetstream.StreamConfig{Name: "shop-sink-dlq", Subjects: []string{"shop.sinkdlq.>"}}); err != nil {
		t.Fatal(err)
	}
	stamp := leasehold.Stamp{Scope: "shop", Partition: 1, Epoch: 7, Acquisition: "a7", Key: "shop.1.9.0", Worker: "w7"}
	dl := nats.NewMsg("shop.sinkdlq.kv")
	stamp.SetHeader(dl.Header)
	dl.Header.Set("Leasehold-Sink-Subject", "shop.out.orders")
	dl.Header.Set("Leasehold-Sink-Error", "kv: the value is too large")
	dl.Header.Set(worker.HeaderJobID, "job-9") // a job header: not replayed
	dl.Data = []byte(`{"order":"o-9"}`)
	ack, err := e.js.PublishMsg(ctx, dl)
	if err != nil {
		t.Fatal(err)
	}
	code, body = post(t, url+"actions/dlq/replay", map[string]any{"stream": "shop-sink-dlq", "seq": ack.Sequence}, bearer)
	if code != 200 || !strings.Contains(body, "replayed to shop.out.orders (shop-effects sequence") {
		t.Fatalf("the sink's dead letter: %d %s", code, body)
	}
	effects, err := e.js.Stream(ctx, worker.EffectsStream("shop"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := effects.GetLastMsgForSubject(ctx, "shop.out.orders")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := leasehold.StampFromHeader(m.Header); err != nil || got != stamp || m.Header.Get(worker.HeaderJobID) != "" ||
		m.Header.Get(leasehold.HeaderReplayOf) != worker.ReplayOf("shop-sink-dlq", ack.Sequence) || string(m.Data) != `{"order":"o-9"}` {
		t.Fatalf("the replayed effect: %v %v %q", m.Header, err, m.Data)
	}
	sinkDLQ, err := e.js.Stream(ctx, "shop-sink-dlq")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sinkDLQ.GetMsg(ctx, ack.Sequence); !errors.Is(err, jetstream.ErrMsgNotFound) {
		t.Fatalf("the replayed dead letter is still there: %v", err)
	}
	// The actions are events, with who did them and how they went.
	waitState(t, ctx, url, "the actions as events", func(st State) bool {
		// The replay of a missing dead letter got past the checks: it
		// is an action that failed.
		return len(st.Actions) == 3 && st.Actions[0].Actor == "token holder" && st.Actions[0].Action == ActionReplay && st.Actions[0].Target == fmt.Sprintf("shop-sink-dlq %d", ack.Sequence) &&
			st.Actions[1].Action == ActionPurge && !st.Actions[0].Failed && !st.Actions[1].Failed &&
			st.Actions[2].Failed && st.Actions[2].Target == fmt.Sprintf("shop-dlq %d", seq+1000) && strings.Contains(st.Actions[2].Result, "no dead letter at sequence")
	})

	// Behind a proxy: the user is the header's, and only with it.
	p := newActionsEnv(t, ctx, ActionsConfig{IdentityHeader: "X-Forwarded-User"})
	pOrigin := strings.TrimSuffix(p.page.URL(), "/")
	if code, body := post(t, p.page.URL()+"actions/login", map[string]any{}, http.Header{"Origin": {pOrigin}}); code != 401 || !strings.Contains(body, "X-Forwarded-User") {
		t.Errorf("a login without the proxy's header: %d %s", code, body)
	}
	if code, body := post(t, p.page.URL()+"actions/login", map[string]any{}, http.Header{"Origin": {pOrigin}, "X-Forwarded-User": {"alice"}}); code != 200 || !strings.Contains(body, `"who":"alice"`) {
		t.Errorf("a login with the proxy's header: %d %s", code, body)
	}
	if code, _ := post(t, p.page.URL()+"actions/jobs/cancel", map[string]any{"ref": "0:1"}, http.Header{"Origin": {pOrigin}, "Authorization": {"Bearer anything-at-all-here"}, "X-Forwarded-User": {"alice"}}); code != 401 {
		t.Errorf("a bearer token where none is configured: %d, want 401", code)
	}
}
