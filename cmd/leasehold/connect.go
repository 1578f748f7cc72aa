package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/pflag"
)

// natsFlags are the connection settings every NATS-facing command takes.
type natsFlags struct {
	url, user, password, nkey, creds string
	tlsCert, tlsKey, tlsCA           string
	prefix, bucket                   string
}

func (n *natsFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&n.url, "nats", nats.DefaultURL, "NATS server URL(s), comma-separated")
	fs.StringVar(&n.user, "user", "", "NATS user name")
	fs.StringVar(&n.password, "password", "", "NATS password")
	fs.StringVar(&n.nkey, "nkey", "", "file holding an nkey seed to authenticate with")
	fs.StringVar(&n.creds, "creds", "", "NATS credentials file (JWT and seed)")
	fs.StringVar(&n.tlsCert, "tls-cert", "", "client certificate file for TLS")
	fs.StringVar(&n.tlsKey, "tls-key", "", "client key file for TLS")
	fs.StringVar(&n.tlsCA, "tls-ca", "", "CA file to verify the server with")
	fs.StringVar(&n.prefix, "prefix", "leasehold", "subject and stream prefix of the job streams")
	fs.StringVar(&n.bucket, "bucket", "", "lease bucket name (default \"<prefix>-leases\": each job stream has its own)")
}

// leaseBucket is the lease bucket's name: --bucket, or the job stream's
// own, "<prefix>-leases".
func (n *natsFlags) leaseBucket() string {
	if n.bucket != "" {
		return n.bucket
	}
	return n.prefix + "-leases"
}

func (n *natsFlags) options(name string) ([]nats.Option, error) {
	opts := []nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.Timeout(5 * time.Second),
	}
	if n.user != "" || n.password != "" {
		opts = append(opts, nats.UserInfo(n.user, n.password))
	}
	if n.nkey != "" {
		o, err := nats.NkeyOptionFromSeed(n.nkey)
		if err != nil {
			return nil, fmt.Errorf("--nkey %s: %w (the file must hold an nkey seed, as written by `nk -gen user`)", n.nkey, err)
		}
		opts = append(opts, o)
	}
	if n.creds != "" {
		if _, err := os.Stat(n.creds); err != nil {
			return nil, fmt.Errorf("--creds: %w", err)
		}
		opts = append(opts, nats.UserCredentials(n.creds))
	}
	if (n.tlsCert == "") != (n.tlsKey == "") {
		return nil, errors.New("--tls-cert and --tls-key go together: give both or neither")
	}
	if n.tlsCert != "" {
		opts = append(opts, nats.ClientCert(n.tlsCert, n.tlsKey))
	}
	if n.tlsCA != "" {
		opts = append(opts, nats.RootCAs(n.tlsCA))
	}
	return opts, nil
}

// connect opens a connection and a JetStream context, and checks that
// JetStream answers, so a wrong URL or a server without JetStream fails
// here with a message that says so.
func (n *natsFlags) connect(ctx context.Context, name string) (*nats.Conn, jetstream.JetStream, error) {
	opts, err := n.options(name)
	if err != nil {
		return nil, nil, err
	}
	nc, err := nats.Connect(n.url, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to NATS at %s: %w (is the server running? set --nats or NATS_URL)", n.url, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(actx); err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("NATS at %s answers but JetStream does not: %w (start nats-server with -js, or check the account's JetStream limits)", nc.ConnectedUrlRedacted(), err)
	}
	return nc, js, nil
}
