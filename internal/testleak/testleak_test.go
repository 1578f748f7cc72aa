package testleak

import (
	"strings"
	"testing"
	"time"
)

// A goroutine on its way out is waited for; one that never ends is found.
func TestSettle(t *testing.T) {
	ending := make(chan struct{})
	go func() { <-ending }()
	time.AfterFunc(200*time.Millisecond, func() { close(ending) })
	if err := settle(Grace); err != nil {
		t.Fatalf("a goroutine that ends after 200 ms was reported: %v", err)
	}

	stuck := make(chan struct{})
	go func() { <-stuck }()
	defer close(stuck)
	err := settle(300 * time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "TestSettle") {
		t.Fatalf("a goroutine that never ends was not reported: %v", err)
	}
}
