package history

import (
	"os"
	"path/filepath"
	"testing"
)

func TestRoundTripAndTornLine(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	w, err := Create(dir, "worker-1")
	if err != nil {
		t.Fatal(err)
	}
	w.Record(Event{Kind: Acquire, Partition: 3, Epoch: 42})
	w.Record(Event{Kind: Effect, Partition: 3, Epoch: 42, Key: "k", Seq: 7})
	w.Close()
	// A process killed mid-line leaves a torn last line.
	f, _ := os.OpenFile(filepath.Join(dir, "worker-1.jsonl"), os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString(`{"t":"2026-01-01T00:00:00Z","proc":"worker-1","ki`)
	f.Close()
	var nilW *Writer
	nilW.Record(Event{Kind: Fault}) // a nil writer records nothing
	evs, err := Read(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 2 || evs[0].Proc != "worker-1" || evs[1].Key != "k" || evs[1].Seq != 7 || evs[0].Time.IsZero() {
		t.Fatalf("read back %+v", evs)
	}
	// A bad line in the middle is an error, not silently skipped.
	os.WriteFile(filepath.Join(dir, "bad.jsonl"), []byte("{\n{\"kind\":\"fault\"}\n"), 0o644)
	if _, err := Read(dir); err == nil {
		t.Fatal("a corrupt line in the middle of a file was accepted")
	}
}
