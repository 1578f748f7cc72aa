package fleet

import (
	"bytes"
	"fmt"
	"os"
	"testing"
	"time"
)

func TestMain(m *testing.M) {
	if IsChild() {
		// The child: wait for a signal.
		time.Sleep(time.Minute)
		os.Exit(3)
	}
	os.Exit(m.Run())
}

func TestPauseResumeKillStop(t *testing.T) {
	t.Parallel()
	p, err := Start("child", []string{"-test.run=^$"}, Options{LogDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Pause(); err != nil {
		t.Fatal(err)
	}
	// A paused child's state is T (stopped) in /proc.
	if st := waitState(t, p.Pid(), 'T'); st != 'T' {
		t.Fatalf("paused child in state %c", st)
	}
	if err := p.Resume(); err != nil {
		t.Fatal(err)
	}
	if st := waitState(t, p.Pid(), 'S'); st == 'T' {
		t.Fatal("resumed child still stopped")
	}
	if err := p.Stop(5 * time.Second); err == nil {
		t.Fatal("a child killed by SIGTERM reported a clean exit")
	}
	if err := p.Pause(); err == nil {
		t.Fatal("signalled an exited child")
	}

	q, err := Start("child2", []string{"-test.run=^$"}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	q.Kill()
	select {
	case <-q.Exited():
	case <-time.After(5 * time.Second):
		t.Fatal("killed child did not exit")
	}
}

// waitState waits up to 2s for the process to reach state want (a
// /proc/<pid>/stat state letter) and returns the last state seen.
func waitState(t *testing.T, pid int, want byte) byte {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Fatal(err)
		}
		st := b[bytes.LastIndexByte(b, ')')+2] // "pid (comm) S ..."
		if st == want || time.Now().After(deadline) {
			return st
		}
		time.Sleep(10 * time.Millisecond)
	}
}
