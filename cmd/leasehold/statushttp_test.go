package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// notifyBuffer is a command's output that tells when a line matching re
// has been written.
type notifyBuffer struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	re    *regexp.Regexp
	match chan string // receives the first match's group, once
	sent  bool
}

func (b *notifyBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Write(p)
	if m := b.re.FindStringSubmatch(b.buf.String()); m != nil && !b.sent {
		b.match <- m[1]
		b.sent = true
	}
	return len(p), nil
}

func (b *notifyBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// `status --http` says where its page is: an address a browser can open,
// the port the system picked for ":0" included.
func TestStatusHTTPLogsThePagesAddress(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, time.Minute)
	mustRun(t, ctx, "init", "--nats", s.URL(), "--partitions", "2")
	out := &notifyBuffer{re: regexp.MustCompile(`serving the status page at (http://\S+/)`), match: make(chan string, 1)}
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	root := newRoot()
	root.SetOut(out)
	root.SetErr(out)
	root.SetArgs([]string{"status", "--nats", s.URL(), "--http", "127.0.0.1:0"})
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(sctx) }()
	var url string
	select {
	case url = <-out.match:
	case err := <-done:
		t.Fatalf("status --http stopped (%v) without saying where its page is:\n%s", err, out)
	case <-ctx.Done():
		t.Fatalf("status --http never said where its page is:\n%s", out)
	}
	if !strings.HasPrefix(url, "http://127.0.0.1:") || strings.HasSuffix(url, ":0/") {
		t.Errorf("the page's address %q is not one to open", url)
	}
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "<html") {
		t.Errorf("GET %s: %d\n%.300s", url, resp.StatusCode, body)
	}
	stop()
	if err := <-done; err != nil {
		t.Errorf("status --http: %v", err)
	}
}
