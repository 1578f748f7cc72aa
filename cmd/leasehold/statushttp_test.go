package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// `status --http` says where its page is: an address a browser can open,
// the port the system picked for ":0" included.
func TestStatusHTTPLogsThePagesAddress(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, time.Minute)
	mustRun(t, ctx, "init", "--nats", s.URL(), "--partitions", "2")
	url := startStatus(t, ctx, "--nats", s.URL(), "--http", "127.0.0.1:0")
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
}
