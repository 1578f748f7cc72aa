package httpsink_test

import (
	"encoding/pem"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/sink/httpsink"
)

// An https receiver whose certificate the system does not trust is
// reached with its CA given in TLSConfig.CAFile; without it, no request
// is taken (the failure is retried, then dead-lettered, saying why), so
// a relay never sends an effect to a receiver it could not verify.
func TestTLSReceiverVerified(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "tls")
	rc := newReceiver(t, httpsink.VerifierConfig{RequireRelay: true})
	srv := httptest.NewTLSServer(rc.handler())
	defer srv.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	e.barrier(1)
	untrusted := e.publish("hook", e.stamp(1, "k-untrusted"), []byte(`{}`), nil)
	rcfg := e.runnerConfig()
	rcfg.MaxDeliveries = 2
	a := e.startRelay(httpsink.Config{URL: srv.URL, Coordinator: e.coord("relay-a")}, rcfg)
	a.waitPosition(t, untrusted)
	if n := rc.count("k-untrusted"); n != 0 {
		t.Fatalf("a relay without the CA delivered to the receiver %d times", n)
	}
	dl := e.deadLetters()
	if len(dl) != 1 || !strings.Contains(dl[0].Header.Get("Leasehold-Sink-Error"), "certificate") {
		t.Fatalf("want the effect dead-lettered for the certificate, got %d dead letters %v", len(dl), dl)
	}
	if err := a.stop(); err != nil {
		t.Fatal(err)
	}
	trusted := e.publish("hook", e.stamp(1, "k-trusted"), []byte(`{}`), nil)
	b := e.startRelay(httpsink.Config{URL: srv.URL, Coordinator: e.coord("relay-b"), TLS: httpsink.TLSConfig{CAFile: ca}}, rcfg)
	b.waitPosition(t, trusted)
	rc.waitCalls(t, map[string]int{"k-trusted": 1})
}
