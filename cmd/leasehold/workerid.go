package main

import (
	"crypto/rand"
	"encoding/hex"
	"os"
)

// defaultWorkerID is the ID of a worker started without --worker-id: the
// host name and six random hex digits, unique per process. Two workers on
// one host then never share an ID, and neither does a restarted container
// (same host name, and pid 1 again) with its previous run, whose
// registration it would otherwise wait out. The host name keeps the ID
// telling in `leasehold status` and on the page.
func defaultWorkerID() string {
	host, _ := os.Hostname()
	var b [3]byte
	_, _ = rand.Read(b[:]) // crypto/rand does not fail on supported platforms
	if host == "" {
		host = "worker"
	}
	return sanitize(host) + "-" + hex.EncodeToString(b[:])
}
