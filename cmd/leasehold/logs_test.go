package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/internal/fleet"
)

// Two worker processes; one is frozen (SIGSTOP) past its lease TTL and
// resumed, as in the demo. The other logs each take-over at INFO with the
// previous holder; neither logs a drain that nobody asked for, a
// membership registration as a partition, empty fields on lease-lost
// lines, or its start and stop twice.
func TestFrozenWorkerLogs(t *testing.T) {
	t.Parallel()
	defer oneFleet(t)()
	if testing.Short() {
		t.Skip("runs worker processes through a freeze")
	}
	// The deadline only bounds a run that is stuck: on a busy machine
	// (load 25) the whole freeze and take-back took longer than 45 s.
	s, ctx := initialized(t, 2*time.Minute, "--partitions", "4")
	dir := t.TempDir()
	procs := map[string]*fleet.Proc{}
	for _, name := range []string{"alice", "bob"} {
		p, err := fleet.Start(name, []string{"worker", "--nats", s.URL(), "--worker-id", name, "--ttl", "2s", "--work-time", "20ms",
			"--http", "", "--log-level", "info", "--pid-file", filepath.Join(dir, name+".pid")}, fleet.Options{LogDir: dir})
		if err != nil {
			t.Fatal(err)
		}
		procs[name] = p
		t.Cleanup(func() { _ = p.Stop(30 * time.Second) })
	}
	if out, err := run(t, ctx, "enqueue", "--nats", s.URL(), "-n", "2000"); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	logOf := func(name string) string {
		b, _ := os.ReadFile(filepath.Join(dir, name+".log"))
		return string(b)
	}
	// waitLog waits until name's log has more than after lines matching re.
	waitLog := func(name, what string, re *regexp.Regexp, after int) {
		t.Helper()
		for len(re.FindAllString(logOf(name), -1)) <= after {
			if ctx.Err() != nil {
				t.Fatalf("%s never logged %s:\n%s\n\nalice:\n%s\n\nbob:\n%s", name, what, re, logOf("alice"), logOf("bob"))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	// holders waits until the partitions are held by exactly these workers.
	holders := func(what string, want ...string) {
		t.Helper()
		for {
			out, err := run(t, ctx, "status", "--nats", s.URL(), "--json")
			var st coordinator.Status
			if err == nil && json.Unmarshal([]byte(out), &st) == nil {
				seen := map[string]bool{}
				for _, p := range st.Partitions {
					seen[p.Holder] = true
				}
				if len(seen) == len(want) && !seen[""] && seen[want[0]] && seen[want[len(want)-1]] {
					return
				}
			}
			if ctx.Err() != nil {
				t.Fatalf("partitions never %s: %v\n%s\n\nalice:\n%s\n\nbob:\n%s", what, err, out, logOf("alice"), logOf("bob"))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	holders("shared by alice and bob", "alice", "bob")
	// --pid-file names exactly this process, for kill -STOP $(cat FILE).
	if b, err := os.ReadFile(filepath.Join(dir, "alice.pid")); err != nil || strings.TrimSpace(string(b)) != strconv.Itoa(procs["alice"].Pid()) {
		t.Fatalf("alice.pid holds %q (%v), want %d", b, err, procs["alice"].Pid())
	}
	if err := procs["alice"].Pause(); err != nil {
		t.Fatal(err)
	}
	// Her leases run out; bob takes her partitions over.
	holders("all held by bob while alice is frozen", "bob")
	waitLog("bob", "taking alice's partitions over", regexp.MustCompile(`level=INFO msg="took over partition" partition=\d+ epoch=\d+ worker=bob from=alice previous_epoch=\d+`), 0)
	// Bob releases them to her: a hand-off, not a take-over.
	takeBack := regexp.MustCompile(`msg="partition handed off" partition=\d+ epoch=\d+ worker=alice from=bob`)
	takenBack := len(takeBack.FindAllString(logOf("alice"), -1))
	if err := procs["alice"].Resume(); err != nil {
		t.Fatal(err)
	}
	waitLog("alice", "the loss of her leases", regexp.MustCompile(`msg="(lease lost|membership registration lost)"`), 0)
	// She rejoins and gets her share back.
	waitLog("alice", "taking a partition back", takeBack, takenBack)
	for _, p := range procs {
		_ = p.Term()
	}
	for _, p := range procs {
		_ = p.Stop(30 * time.Second)
	}
	for _, name := range []string{"alice", "bob"} {
		out := logOf(name)
		for _, bad := range []string{"drain ran out of time", "member=true", `holder=""`, "err=<nil>"} {
			if strings.Contains(out, bad) {
				t.Errorf("%s's log has %q:\n%s", name, bad, out)
			}
		}
		if _, err := os.Stat(filepath.Join(dir, name+".pid")); !os.IsNotExist(err) {
			t.Errorf("%s's pid file outlived the worker: %v", name, err)
		}
		for _, once := range []string{`msg="worker starting"`, `msg="worker stopped"`} {
			if n := strings.Count(out, once); n != 1 {
				t.Errorf("%s logged %s %d times:\n%s", name, once, n, out)
			}
		}
	}
}
