package testbuf

import (
	"strings"
	"sync"
	"testing"
)

// Writers in several goroutines and a reader at the same time: under the
// race detector a Buffer without its lock fails here, and every write is
// kept whole.
func TestConcurrentWritesAndReads(t *testing.T) {
	var b Buffer
	const writers, lines = 4, 200
	var wg sync.WaitGroup
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range lines {
				if _, err := b.Write([]byte("line\n")); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	for range lines {
		_ = b.String()
	}
	wg.Wait()
	if got := strings.Count(b.String(), "line\n"); got != writers*lines {
		t.Fatalf("%d lines, want %d", got, writers*lines)
	}
}
