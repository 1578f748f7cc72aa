// Package headless drives a headless Chromium over the DevTools protocol,
// for the tests of the status page: load it, evaluate script in it, wait
// for what it shows, and take a screenshot. Import it from tests only.
package headless

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testskip"
)

// Browser is a headless Chromium driven over the DevTools protocol on a
// pipe (--remote-debugging-pipe: commands on fd 3, answers on fd 4, each
// message ending in a NUL byte), as Playwright drives it. No websocket and
// no module beyond the standard library.
type Browser struct {
	cmd     *exec.Cmd
	toPipe  *os.File
	mu      sync.Mutex
	next    int
	waiting map[int]chan cdpReply
	session string
	done    chan struct{}
}

type cdpReply struct {
	ID     int             `json:"id"`
	Result json.RawMessage `json:"result"`
	Error  *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// Path finds Chromium, or skips the test with the reason; with
// LEASEHOLD_REQUIRE_CHROMIUM=1 (as CI sets it) a missing Chromium fails it.
func Path(t *testing.T) string {
	t.Helper()
	for _, name := range []string{os.Getenv("LEASEHOLD_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"} {
		if name == "" {
			continue
		}
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("LEASEHOLD_REQUIRE_CHROMIUM") == "1" {
		t.Fatal("LEASEHOLD_REQUIRE_CHROMIUM=1 but no Chromium found (install Debian's chromium package, or set LEASEHOLD_CHROMIUM)")
	}
	testskip.Skip(t, testskip.Chromium, "no Chromium found (chromium, chromium-browser, google-chrome or $LEASEHOLD_CHROMIUM): the status page is not tested in a browser")
	return ""
}

// Start starts a headless Chromium with one page showing url.
func Start(t *testing.T, ctx context.Context, url string) *Browser {
	t.Helper()
	path := Path(t)
	cmdR, cmdW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(path, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
		"--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
		"--user-data-dir="+t.TempDir(), "about:blank")
	cmd.ExtraFiles = []*os.File{cmdR, outW} // fd 3 and fd 4
	var stderr tailBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", path, err)
	}
	cmdR.Close()
	outW.Close()
	c := &Browser{cmd: cmd, toPipe: cmdW, waiting: map[int]chan cdpReply{}, done: make(chan struct{})}
	go c.read(outR)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("Chromium's last output:\n%s", stderr.String())
		}
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = c.call(cctx, "", "Browser.close", nil)
		select {
		case <-c.done:
		case <-cctx.Done():
			_ = cmd.Process.Kill()
			<-c.done
		}
		_ = cmd.Wait()
		cmdW.Close()
	})
	var target struct {
		TargetID string `json:"targetId"`
	}
	c.mustCall(t, ctx, "", "Target.createTarget", map[string]any{"url": url}, &target)
	var attached struct {
		SessionID string `json:"sessionId"`
	}
	c.mustCall(t, ctx, "", "Target.attachToTarget", map[string]any{"targetId": target.TargetID, "flatten": true}, &attached)
	c.session = attached.SessionID
	// The target starts on an empty document and the page's server may
	// take a moment to answer: wait for the page's own load event, so that
	// what the test evaluates next runs in the page, not before it.
	var loaded bool
	// (An evaluation in the empty document ends with it, and Await
	// evaluates again in the page.)
	if err := c.Await(ctx, `new Promise(loaded => {
		const check = () => location.protocol.startsWith("http") && document.readyState === "complete" && loaded(true);
		check(); addEventListener("load", check);
	})`, &loaded); err != nil || !loaded {
		t.Fatalf("loading %s: %v", url, err)
	}
	return c
}

func (c *Browser) read(r *os.File) {
	defer close(c.done)
	defer r.Close()
	br := bufio.NewReader(r)
	for {
		msg, err := br.ReadBytes(0)
		if err != nil {
			c.mu.Lock()
			for id, ch := range c.waiting {
				close(ch)
				delete(c.waiting, id)
			}
			c.mu.Unlock()
			return
		}
		var rep cdpReply
		if json.Unmarshal(msg[:len(msg)-1], &rep) != nil || rep.ID == 0 {
			continue // an event
		}
		c.mu.Lock()
		ch := c.waiting[rep.ID]
		delete(c.waiting, rep.ID)
		c.mu.Unlock()
		if ch != nil {
			ch <- rep
		}
	}
}

func (c *Browser) call(ctx context.Context, session, method string, params any) (json.RawMessage, error) {
	c.mu.Lock()
	c.next++
	id := c.next
	ch := make(chan cdpReply, 1)
	c.waiting[id] = ch
	c.mu.Unlock()
	msg := map[string]any{"id": id, "method": method, "params": params}
	if params == nil {
		msg["params"] = map[string]any{}
	}
	if session != "" {
		msg["sessionId"] = session
	}
	b, err := json.Marshal(msg)
	if err != nil {
		return nil, err
	}
	if _, err := c.toPipe.Write(append(b, 0)); err != nil {
		return nil, fmt.Errorf("%s: %w", method, err)
	}
	select {
	case rep, ok := <-ch:
		if !ok {
			return nil, fmt.Errorf("%s: Chromium closed the pipe", method)
		}
		if rep.Error != nil {
			return nil, fmt.Errorf("%s: %s", method, rep.Error.Message)
		}
		return rep.Result, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("%s: %w", method, ctx.Err())
	}
}

func (c *Browser) mustCall(t *testing.T, ctx context.Context, session, method string, params, result any) {
	t.Helper()
	raw, err := c.call(ctx, session, method, params)
	if err != nil {
		t.Fatal(err)
	}
	if result != nil {
		if err := json.Unmarshal(raw, result); err != nil {
			t.Fatalf("%s: %v", method, err)
		}
	}
}

// Eval evaluates a JavaScript expression in the page and decodes its
// value into v.
func (c *Browser) Eval(ctx context.Context, expr string, v any) error {
	return c.evaluate(ctx, expr, false, v)
}

// Await evaluates expr, an expression whose value is a promise, and
// waits for it to settle: for a page to dispatch an event, say, rather
// than polling what it shows. It decodes the promise's value into v.
func (c *Browser) Await(ctx context.Context, expr string, v any) error {
	for {
		err := c.evaluate(ctx, expr, true, v)
		// A page still loading replaces the context it is evaluated in:
		// evaluate again in the new one.
		if err == nil || !strings.Contains(err.Error(), "context was destroyed") && !strings.Contains(err.Error(), "Cannot find context") {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (c *Browser) evaluate(ctx context.Context, expr string, await bool, v any) error {
	raw, err := c.call(ctx, c.session, "Runtime.evaluate", map[string]any{"expression": expr, "returnByValue": true, "awaitPromise": await})
	if err != nil {
		return err
	}
	var res struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		Exception *struct {
			Text string `json:"text"`
		} `json:"exceptionDetails"`
	}
	if err := json.Unmarshal(raw, &res); err != nil {
		return err
	}
	if res.Exception != nil {
		return fmt.Errorf("%s: %s", expr, res.Exception.Text)
	}
	if len(res.Result.Value) == 0 {
		return fmt.Errorf("%s: no value", expr)
	}
	return json.Unmarshal(res.Result.Value, v)
}

// WaitFor evaluates expr (which must return a boolean) until it is true,
// polling every 250ms until ctx ends.
func (c *Browser) WaitFor(t *testing.T, ctx context.Context, what, expr string) {
	t.Helper()
	var lastErr error
	for {
		var ok bool
		if lastErr = c.Eval(ctx, expr, &ok); lastErr == nil && ok {
			return
		}
		select {
		case <-ctx.Done():
			var body string
			bctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = c.Eval(bctx, "document.body.innerText", &body)
			cancel()
			t.Fatalf("the page never showed %s (last error: %v); it shows:\n%s", what, lastErr, body)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// tailBuffer keeps the last 8 KiB written to it.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if len(b.buf) > 8<<10 {
		b.buf = b.buf[len(b.buf)-8<<10:]
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}

// Screenshot returns a PNG of the page as it is shown now.
func (c *Browser) Screenshot(ctx context.Context) ([]byte, error) {
	raw, err := c.call(ctx, c.session, "Page.captureScreenshot", map[string]any{"format": "png", "captureBeyondViewport": true})
	if err != nil {
		return nil, err
	}
	var shot struct {
		Data string `json:"data"`
	}
	if err := json.Unmarshal(raw, &shot); err != nil {
		return nil, err
	}
	return base64.StdEncoding.DecodeString(shot.Data)
}
