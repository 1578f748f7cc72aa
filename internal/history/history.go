// Package history records what a leasehold process did, one JSON object a
// line, for the chaos harness's checker and the demo's summary. Each
// process appends to its own file; every record is one write(2) on a file
// opened with O_APPEND, so a process killed mid-run leaves whole lines
// (at worst it loses the line it was writing).
package history

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// Kinds of events.
const (
	Enqueue  = "enqueue"  // a producer stored a job (Partition, Seq, JobID)
	Acquire  = "acquire"  // a worker acquired a partition (Partition, Epoch)
	Lose     = "lose"     // a worker lost a partition (Partition, Epoch, Reason, Holder)
	Release  = "release"  // a worker released a partition (Partition, Epoch)
	Start    = "start"    // a handler took a stamp and began its work (Partition, Epoch, Key, Seq)
	Effect   = "effect"   // a worker sent an effect (Partition, Epoch, Key, Seq)
	Decision = "decision" // a sink decided on an effect (Partition, Epoch, Key, Outcome, Max, Position)
	Commit   = "commit"   // a worker committed progress (Partition, Epoch, Seq)
	Fault    = "fault"    // the harness injected a fault (Proc is the target, Reason the fault)
	// Attempt: an attempt of a job ended (Partition, Epoch, Seq: the job,
	// Attempt: its number on the wire, Outcome: AttemptCompleted or
	// AttemptFailed).
	Attempt = "attempt"
)

// Outcomes of an Attempt event.
const (
	AttemptCompleted = "completed" // the handler returned nil and the job's effects were marked final
	AttemptFailed    = "failed"    // the attempt failed: retried, dead-lettered, timed out or cut off
)

// Event is one line of history. Fields that do not apply are left empty.
type Event struct {
	Time      time.Time `json:"t"`
	Proc      string    `json:"proc"`
	Kind      string    `json:"kind"`
	Partition uint32    `json:"p"`
	Epoch     uint64    `json:"epoch,omitempty"`
	Key       string    `json:"key,omitempty"`
	Seq       uint64    `json:"seq,omitempty"`
	JobID     string    `json:"job,omitempty"`
	Outcome   string    `json:"outcome,omitempty"`
	Max       uint64    `json:"max,omitempty"`
	Holder    string    `json:"holder,omitempty"`
	Reason    string    `json:"reason,omitempty"`
	Position  uint64    `json:"pos,omitempty"` // a sink's position in its log, when it has one
	Attempt   uint64    `json:"attempt,omitempty"`
}

// Writer appends events to a file. A nil *Writer records nothing, so
// callers need not check whether history is on.
type Writer struct {
	proc string
	mu   sync.Mutex
	f    *os.File
	buf  []byte
}

// Create opens dir/<proc>.jsonl for appending, creating dir if needed.
func Create(dir, proc string) (*Writer, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("history: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, proc+".jsonl"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("history: %w", err)
	}
	return &Writer{proc: proc, f: f}, nil
}

// Record appends e, filling in the time and process when they are empty.
func (w *Writer) Record(e Event) {
	if w == nil {
		return
	}
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	if e.Proc == "" {
		e.Proc = w.proc
	}
	line, err := json.Marshal(e)
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(append(w.buf[:0], line...), '\n')
	_, _ = w.f.Write(w.buf)
}

// Close closes the file.
func (w *Writer) Close() error {
	if w == nil {
		return nil
	}
	return w.f.Close()
}

// Read returns every event in the *.jsonl files of dir, in file order. A
// torn last line (a process killed while writing it) is skipped.
func Read(dir string) ([]Event, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.jsonl"))
	if err != nil {
		return nil, err
	}
	var all []Event
	for _, name := range files {
		f, err := os.Open(name)
		if err != nil {
			return nil, err
		}
		evs, err := decode(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("history: %s: %w", name, err)
		}
		all = append(all, evs...)
	}
	return all, nil
}

func decode(r io.Reader) ([]Event, error) {
	var out []Event
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var pending error
	for sc.Scan() {
		if pending != nil {
			return nil, pending // a bad line that was not the last one
		}
		var e Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			pending = fmt.Errorf("bad line %q: %w", sc.Text(), err)
			continue
		}
		out = append(out, e)
	}
	if err := sc.Err(); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return out, nil
}
