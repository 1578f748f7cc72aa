package main

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// postJSON posts body to url with a bearer token and the page's origin.
func postJSON(t *testing.T, url, token, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// `status --http --actions-token-file` turns the page's actions on for the
// token in the file, and for nobody else; without it they are off.
func TestStatusActionsTokenFile(t *testing.T) {
	t.Parallel()
	s, ctx := listening(t, time.Minute)
	mustRun(t, ctx, "init", "--nats", s.URL(), "--partitions", "2")
	const token = "0123456789abcdef0123456789abcdef"
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	on := startStatus(t, ctx, "--nats", s.URL(), "--http", "127.0.0.1:0", "--actions-token-file", file)
	if code, body := httpGet(on + "actions/session"); code != 200 || !strings.Contains(body, `"enabled":true`) {
		t.Fatalf("actions/session: %d %s", code, body)
	}
	// The token passes; what it asks for is then checked.
	if code, body := postJSON(t, on+"actions/jobs/cancel", token, `{"ref":"seven"}`); code != http.StatusBadRequest || !strings.Contains(body, "job reference") {
		t.Errorf("with the file's token: %d %s, want 400 for the reference", code, body)
	}
	if code, body := postJSON(t, on+"actions/jobs/cancel", token+"0", `{"ref":"0:1"}`); code != http.StatusUnauthorized {
		t.Errorf("with another token: %d %s, want 401", code, body)
	}
	off := startStatus(t, ctx, "--nats", s.URL(), "--http", "127.0.0.1:0")
	if code, body := postJSON(t, off+"actions/jobs/cancel", token, `{"ref":"0:1"}`); code != http.StatusForbidden || !strings.Contains(body, "actions are off") {
		t.Errorf("without --actions-token-file: %d %s, want 403", code, body)
	}

	short := filepath.Join(t.TempDir(), "short")
	if err := os.WriteFile(short, []byte("abc"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		says string
	}{
		{[]string{"--http", "127.0.0.1:0", "--actions-token-file", short}, "fewer than 16"},
		{[]string{"--http", "127.0.0.1:0", "--actions-token-file", filepath.Join(t.TempDir(), "missing")}, "--actions-token-file"},
		{[]string{"--actions-token-file", file}, "need --http"},
		{[]string{"--http", "127.0.0.1:0", "--actions-token-file", file, "--actions-origin", "status.example.com"}, "scheme://host"},
	} {
		if out, err := run(t, ctx, append([]string{"status", "--nats", s.URL()}, c.args...)...); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("status %v: %v\n%s", c.args, err, out)
		}
	}
}

// The token may come from the environment instead, and not from both.
func TestStatusActionsTokenFromEnvironment(t *testing.T) {
	const token = "fedcba9876543210fedcba9876543210"
	t.Setenv(actionsTokenEnv, token)
	s, ctx := listening(t, time.Minute)
	mustRun(t, ctx, "init", "--nats", s.URL(), "--partitions", "2")
	url := startStatus(t, ctx, "--nats", s.URL(), "--http", "127.0.0.1:0")
	if code, body := postJSON(t, url+"actions/jobs/cancel", token, `{"ref":"seven"}`); code != http.StatusBadRequest {
		t.Errorf("with the environment's token: %d %s, want 400 for the reference", code, body)
	}
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, ctx, "status", "--nats", s.URL(), "--http", "127.0.0.1:0", "--actions-token-file", file); err == nil || !strings.Contains(err.Error(), "not both") {
		t.Errorf("a token in both: %v", err)
	}
}
