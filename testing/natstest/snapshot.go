package natstest

import (
	"os"
	"path/filepath"
	"testing"
)

// StoreSnapshot is a copy of a stopped server's JetStream store, taken by
// Server.Snapshot.
type StoreSnapshot struct {
	dir string
}

// Snapshot copies the store of s, which must be stopped (Shutdown), into a
// temporary directory removed when the test ends. Restoring it later puts
// the server back where it was, forgetting every write acknowledged since:
// what a restore from backup does, or a power failure on a server that
// does not sync every write (sync_interval other than always).
func (s *Server) Snapshot(tb testing.TB) *StoreSnapshot {
	tb.Helper()
	if s.Running() {
		tb.Fatal("natstest: Snapshot of a running server: call Shutdown first, a live store is not consistent on disk")
	}
	dir := filepath.Join(tb.TempDir(), "store")
	if err := os.CopyFS(dir, os.DirFS(s.cfg.StoreDir)); err != nil {
		tb.Fatalf("natstest: copy the store of %s: %v", s.cfg.StoreDir, err)
	}
	return &StoreSnapshot{dir: dir}
}

// Restore replaces the store of s, which must be stopped, with snap. Start
// it again with Restart.
func (s *Server) Restore(tb testing.TB, snap *StoreSnapshot) {
	tb.Helper()
	if s.Running() {
		tb.Fatal("natstest: Restore into a running server: call Shutdown first")
	}
	if err := os.RemoveAll(s.cfg.StoreDir); err != nil {
		tb.Fatalf("natstest: clear the store %s: %v", s.cfg.StoreDir, err)
	}
	if err := os.CopyFS(s.cfg.StoreDir, os.DirFS(snap.dir)); err != nil {
		tb.Fatalf("natstest: restore the store %s: %v", s.cfg.StoreDir, err)
	}
}
