package testpar

import (
	"flag"
	"strconv"
	"testing"
)

// Run without -parallel, Raise lifts the limit; the test binary's own
// flags are parsed by then, as in a TestMain.
func TestRaise(t *testing.T) {
	f := flag.Lookup("test.parallel")
	old := f.Value.String()
	t.Cleanup(func() { f.Value.Set(old) })
	f.Value.Set("2")
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	Raise(7)
	got, _ := strconv.Atoi(f.Value.String())
	switch {
	case set && got != 2:
		t.Fatalf("-parallel given on the command line, Raise changed it to %d", got)
	case !set && got != 7:
		t.Fatalf("-test.parallel = %d after Raise(7), want 7", got)
	}
	Raise(3)
	if now, _ := strconv.Atoi(f.Value.String()); now != got {
		t.Fatalf("Raise(3) lowered -test.parallel from %d to %d", got, now)
	}
}
