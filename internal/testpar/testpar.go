// Package testpar lets a package whose tests mostly wait (on lease TTLs,
// expiries, elections, a server's restart) run more of its parallel tests
// at once than go test's default, which is GOMAXPROCS: two on a two-core
// machine, where such tests leave the cores idle while they wait.
//
// A package opts in from its TestMain, before m.Run:
//
//	func TestMain(m *testing.M) {
//		testpar.Raise(6)
//		goleak.VerifyTestMain(m)
//	}
//
// A -parallel given on the command line wins. Import it from tests only.
package testpar

import (
	"flag"
	"strconv"
)

// Raise sets -test.parallel to n unless the command line set it, or it is
// already at least n.
func Raise(n int) {
	if !flag.Parsed() {
		flag.Parse()
	}
	f := flag.Lookup("test.parallel")
	if f == nil {
		return
	}
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if cur, err := strconv.Atoi(f.Value.String()); set || (err == nil && cur >= n) {
		return
	}
	_ = f.Value.Set(strconv.Itoa(n))
}
