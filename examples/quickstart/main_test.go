package main

import (
	"bytes"
	"io"
	"os"
	"regexp"
	"strings"
	"testing"
)

// The README's first program is this one, word for word.
func TestREADMEShowsThisProgram(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	program, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "\n## A first program\n")
	if !ok {
		t.Fatal(`the README has no section "## A first program"`)
	}
	m := regexp.MustCompile("(?s)```go\n(.*?)```\n").FindStringSubmatch(section)
	if m == nil {
		t.Fatal("the README's first program has no Go block")
	}
	if m[1] != string(program) {
		t.Fatalf("the README's first Go block under \"## A first program\" is not examples/quickstart/main.go: copy the file into the README\nREADME:\n%s", m[1])
	}
	if n := strings.Count(string(program), "\n"); n >= 80 {
		t.Fatalf("the program has %d lines; keep it under 80", n)
	}
}

// The program runs to the end on an embedded server: every job done, the
// sink holding a stamped value.
func TestQuickstartRuns(t *testing.T) {
	t.Setenv("NATS_URL", "")
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	out := make(chan string)
	go func() {
		var b bytes.Buffer
		_, _ = io.Copy(&b, r)
		out <- b.String()
	}()
	func() {
		defer func() { os.Stdout = stdout }()
		main()
	}()
	w.Close()
	text := <-out
	t.Log("\n" + text)
	if n := strings.Count(text, ": done\n"); n != 6 {
		t.Errorf("%d of 6 jobs done", n)
	}
	if !regexp.MustCompile(`sink: invoice\.2 = 200 \(partition \d, epoch \d+\)`).MatchString(text) {
		t.Error("the sink does not hold invoice.2")
	}
}
