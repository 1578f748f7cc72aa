package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"

	"github.com/leasehold/leasehold/testing/natstest"
)

// The connection flags end to end: a server that requires each kind of
// authentication, and the CLI provisioning through it (which needs
// JetStream, KV and stream rights) and reading the partition table back.
// Wrong or missing credentials fail with the server's refusal.
func TestAuthentication(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cases := []struct {
		name  string
		tweak func(t *testing.T, o *server.Options) (good, bad []string)
	}{
		{"user and password", func(t *testing.T, o *server.Options) ([]string, []string) {
			o.Users = []*server.User{{Username: "worker", Password: "s3cret"}}
			return []string{"--user", "worker", "--password", "s3cret"}, []string{"--user", "worker", "--password", "wrong"}
		}},
		{"nkey", func(t *testing.T, o *server.Options) ([]string, []string) {
			good, pub := userNkey(t, dir, "good")
			bad, _ := userNkey(t, dir, "bad")
			o.Nkeys = []*server.NkeyUser{{Nkey: pub}}
			return []string{"--nkey", good}, []string{"--nkey", bad}
		}},
		{"creds", func(t *testing.T, o *server.Options) ([]string, []string) {
			good, bad := operatorMode(t, dir, o)
			return []string{"--creds", good}, []string{"--creds", bad}
		}},
		{"tls", func(t *testing.T, o *server.Options) ([]string, []string) {
			ca, srv, client, otherCert, otherKey := certificates(t, dir)
			tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: srv[0], KeyFile: srv[1], CaFile: ca, Verify: true})
			if err != nil {
				t.Fatal(err)
			}
			o.TLSConfig, o.TLS, o.TLSVerify, o.TLSTimeout = tc, true, true, 5
			return []string{"--tls-ca", ca, "--tls-cert", client[0], "--tls-key", client[1]},
				[]string{"--tls-ca", ca, "--tls-cert", otherCert, "--tls-key", otherKey}
		}},
	}
	for _, c := range cases {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			var good, bad []string
			s := natstest.Start(t, natstest.Listen(), natstest.Tweak(func(o *server.Options) { good, bad = c.tweak(t, o) }))
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			url := s.URL()
			args := func(cmd string, cred []string) []string {
				return append([]string{cmd, "--nats", url, "--partitions", "2"}, cred...)
			}
			if out, err := run(t, ctx, args("init", good)...); err != nil {
				t.Fatalf("init with good credentials: %v\n%s", err, out)
			}
			out, err := run(t, ctx, append([]string{"status", "--nats", url, "--json"}, good...)...)
			if err != nil || !strings.Contains(out, `"partitions"`) {
				t.Fatalf("status with good credentials: %v\n%s", err, out)
			}
			for _, cred := range [][]string{bad, nil} {
				out, err := run(t, ctx, append([]string{"status", "--nats", url}, cred...)...)
				if err == nil {
					t.Fatalf("status with credentials %q succeeded:\n%s", cred, out)
				}
				if !strings.Contains(err.Error(), "connect to NATS") {
					t.Fatalf("error %q does not say the connection failed", err)
				}
				t.Logf("refused as expected with %q: %v", cred, err)
			}
		})
	}
}

// The environment carries the same settings, under the nats CLI's names.
func TestAuthenticationFromEnvironment(t *testing.T) {
	dir := t.TempDir()
	good, pub := userNkey(t, dir, "env")
	s := natstest.Start(t, natstest.Listen(), natstest.Tweak(func(o *server.Options) {
		o.Nkeys = []*server.NkeyUser{{Nkey: pub}}
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	t.Setenv("NATS_URL", s.URL())
	t.Setenv("NATS_NKEY", good)
	if out, err := run(t, ctx, "init", "--partitions", "2"); err != nil {
		t.Fatalf("init with NATS_NKEY: %v\n%s", err, out)
	}
	// A seed file that is not a seed fails with a message that says so.
	junk := filepath.Join(dir, "junk.nk")
	os.WriteFile(junk, []byte("not a seed"), 0o600)
	t.Setenv("NATS_NKEY", junk)
	if _, err := run(t, ctx, "status"); err == nil || !strings.Contains(err.Error(), "nkey seed") {
		t.Fatalf("junk nkey: %v", err)
	}
}

// userNkey writes a user nkey seed to a file and returns its path and the
// public key.
func userNkey(t *testing.T, dir, name string) (string, string) {
	t.Helper()
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	pub, _ := kp.PublicKey()
	path := filepath.Join(dir, name+".nk")
	if err := os.WriteFile(path, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, pub
}

// operatorMode configures decentralized JWT authentication: an operator,
// a system account, and an application account with JetStream, whose user
// gets a creds file. The bad creds file is a user of an account the
// operator never signed.
func operatorMode(t *testing.T, dir string, o *server.Options) (good, bad string) {
	t.Helper()
	okp, _ := nkeys.CreateOperator()
	opub, _ := okp.PublicKey()
	oc := jwt.NewOperatorClaims(opub)
	oc.Name = "leasehold-test"
	ojwt, err := oc.Encode(okp)
	if err != nil {
		t.Fatal(err)
	}
	op, err := jwt.DecodeOperatorClaims(ojwt)
	if err != nil {
		t.Fatal(err)
	}
	resolver := &server.MemAccResolver{}
	account := func(name string, js bool) nkeys.KeyPair {
		akp, _ := nkeys.CreateAccount()
		apub, _ := akp.PublicKey()
		ac := jwt.NewAccountClaims(apub)
		ac.Name = name
		if js {
			ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
		}
		ajwt, err := ac.Encode(okp)
		if err != nil {
			t.Fatal(err)
		}
		if err := resolver.Store(apub, ajwt); err != nil {
			t.Fatal(err)
		}
		return akp
	}
	sys := account("SYS", false)
	app := account("APP", true)
	sysPub, _ := sys.PublicKey()
	o.TrustedOperators = []*jwt.OperatorClaims{op}
	o.SystemAccount = sysPub
	o.AccountResolver = resolver
	stranger, _ := nkeys.CreateAccount()
	return creds(t, dir, "good", app), creds(t, dir, "bad", stranger)
}

func creds(t *testing.T, dir, name string, account nkeys.KeyPair) string {
	t.Helper()
	ukp, _ := nkeys.CreateUser()
	upub, _ := ukp.PublicKey()
	uc := jwt.NewUserClaims(upub)
	uc.Name = name
	ujwt, err := uc.Encode(account)
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := ukp.Seed()
	body, err := jwt.FormatUserConfig(ujwt, seed)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, name+".creds")
	if err := os.WriteFile(path, body, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// certificates makes a CA, a server certificate for 127.0.0.1, a client
// certificate signed by the CA and one signed by another CA. It returns
// the CA file, the server and client (cert, key) files, and the foreign
// client's cert and key files.
func certificates(t *testing.T, dir string) (ca string, srv, client [2]string, otherCert, otherKey string) {
	t.Helper()
	caCert, caKey := newCA(t, "leasehold test CA")
	ca = writePEM(t, dir, "ca.pem", "CERTIFICATE", caCert.Raw)
	srv = leaf(t, dir, "server", caCert, caKey, x509.ExtKeyUsageServerAuth)
	client = leaf(t, dir, "client", caCert, caKey, x509.ExtKeyUsageClientAuth)
	otherCA, otherCAKey := newCA(t, "some other CA")
	other := leaf(t, dir, "stranger", otherCA, otherCAKey, x509.ExtKeyUsageClientAuth)
	return ca, srv, client, other[0], other[1]
}

func newCA(t *testing.T, name string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func leaf(t *testing.T, dir, name string, ca *x509.Certificate, caKey *ecdsa.PrivateKey, usage x509.ExtKeyUsage) [2]string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return [2]string{writePEM(t, dir, name+".pem", "CERTIFICATE", der), writePEM(t, dir, name+"-key.pem", "EC PRIVATE KEY", kder)}
}

func writePEM(t *testing.T, dir, name, kind string, der []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
