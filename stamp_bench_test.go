package leasehold_test

import (
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/testing/natstest"
)

// BenchmarkStampOnTheWire measures what an effect's stamp and job mark cost
// a message between two clients of one embedded server, beside the one
// header a raw pipeline's message carries (its Nats-Msg-Id): building the
// headers, the publisher's encoding, the server's routing, the
// subscriber's parsing, and reading the stamp and mark back as a sink
// does, in each form (see leasehold.HeaderStamp). It is the share of
// leasehold's CPU per effect that the headers take, whatever the worker
// and the sink decide around them:
//
//	go test -run '^$' -bench StampOnTheWire -count 5 .
func BenchmarkStampOnTheWire(b *testing.B) {
	stamp := leasehold.Stamp{Scope: "orders", Partition: 7, Epoch: 1796042013866141,
		Acquisition: "a1b2c3d4e5f6a7b8", Key: "orders.7.123456.0", Worker: "worker-3"}
	mark := leasehold.JobMark{Job: 123456, Attempt: 1, Effects: 1, After: 123455}
	b.Run("raw", func(b *testing.B) {
		wire(b, func(h nats.Header) {
			h[nats.MsgIdHdr] = []string{"orders.out.7." + strconv.Itoa(123456)}
		}, func(h nats.Header) error {
			if h.Get(nats.MsgIdHdr) == "" {
				return errors.New("no message ID")
			}
			return nil
		})
	})
	for _, f := range []leasehold.StampFormat{leasehold.StampLegacy, leasehold.StampCompact} {
		b.Run("stamped-"+f.String(), func(b *testing.B) {
			wire(b, func(h nats.Header) {
				stamp.SetHeaderAs(h, f)
				mark.SetHeader(h)
				h[nats.MsgIdHdr] = []string{stamp.Key + "@" + stamp.Epoch.String() + "~0123456789abcdef"}
			}, func(h nats.Header) error {
				if _, err := leasehold.StampFromHeader(h); err != nil {
					return err
				}
				_, err := leasehold.JobMarkFromHeader(h)
				return err
			})
		})
	}
}

// BenchmarkStampHeaders measures writing an effect's stamp and final job
// mark into a fresh header map as a worker does, and reading them back
// from a map as a sink does (beside a message ID and trace context), in
// each form:
//
//	go test -run '^$' -bench StampHeaders -benchmem -count 5 .
func BenchmarkStampHeaders(b *testing.B) {
	stamp := leasehold.Stamp{Scope: "orders", Partition: 7, Epoch: 1796042013866141,
		Acquisition: "a1b2c3d4e5f6a7b8", Key: "orders.7.123456.0", Worker: "worker-3"}
	mark := leasehold.JobMark{Job: 123456, Attempt: 1, Effects: 1, After: 123455}
	for _, f := range []leasehold.StampFormat{leasehold.StampLegacy, leasehold.StampCompact} {
		b.Run("write-"+f.String(), func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				h := make(map[string][]string, 14)
				stamp.SetHeaderAs(h, f)
				mark.SetHeaderAs(h, f)
			}
		})
		b.Run("read-"+f.String(), func(b *testing.B) {
			h := map[string][]string{
				"Nats-Msg-Id": {"orders.7.123456.0@1796042013866141~0123456789abcdef"},
				"Traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
			}
			stamp.SetHeaderAs(h, f)
			mark.SetHeaderAs(h, f)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if _, err := leasehold.StampFromHeader(h); err != nil {
					b.Fatal(err)
				}
				if _, err := leasehold.JobMarkFromHeader(h); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// wire sends b.N messages of 256 bytes, each with the headers set builds,
// from one connection to a subscriber on another that checks each with
// read, and waits until all have arrived.
func wire(b *testing.B, set func(nats.Header), read func(nats.Header) error) {
	srv := natstest.Start(b)
	pub, sub := srv.Connect(b), srv.Connect(b)
	var got atomic.Int64
	done := make(chan struct{})
	want := int64(b.N)
	s, err := sub.Subscribe("wire", func(m *nats.Msg) {
		if err := read(m.Header); err != nil {
			b.Error(err)
		}
		if got.Add(1) == want {
			close(done)
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	if err := s.SetPendingLimits(-1, -1); err != nil {
		b.Fatal(err)
	}
	if err := sub.Flush(); err != nil {
		b.Fatal(err)
	}
	data := make([]byte, 256)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		h := nats.Header{}
		set(h)
		if err := pub.PublishMsg(&nats.Msg{Subject: "wire", Header: h, Data: data}); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-done:
	case <-time.After(time.Minute):
		b.Fatalf("%d of %d messages arrived within a minute", got.Load(), want)
	}
}
