package coordinator

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/testing/natstest"
)

// laggingCopy stands for a stream whose one-replica scan consumer the
// server placed on a follower behind the leader: stream reads through the
// leader go to one server, and the consumer is made on a second server
// holding the same stream with fewer of its writes. A real cluster places
// the consumer on a random peer, which no test can choose.
type laggingCopy struct {
	jetstream.JetStream                     // the leader's
	copy                jetstream.JetStream // the follower's, behind
}

func (l laggingCopy) CreateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return l.copy.CreateConsumer(ctx, stream, cfg)
}

func (l laggingCopy) DeleteConsumer(ctx context.Context, stream, name string) error {
	return l.copy.DeleteConsumer(ctx, stream, name)
}

// lagging returns a leader and a copy of a stream shaped like a KV
// bucket's, the copy holding the first of the writes, the leader all.
func lagging(t *testing.T, ctx context.Context, copied int, writes ...*nats.Msg) laggingCopy {
	t.Helper()
	l := laggingCopy{natstest.Start(t).JetStream(t), natstest.Start(t).JetStream(t)}
	for _, js := range []jetstream.JetStream{l.JetStream, l.copy} {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "KV_scan", Subjects: []string{"$KV.scan.>"}, MaxMsgsPerSubject: 1, AllowRollup: true}); err != nil {
			t.Fatal(err)
		}
	}
	for i, m := range writes {
		targets := []jetstream.JetStream{l.JetStream}
		if i < copied {
			targets = append(targets, l.copy)
		}
		for _, js := range targets {
			if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: m.Subject, Header: m.Header, Data: m.Data}); err != nil {
				t.Fatal(err)
			}
		}
	}
	return l
}

func purge(subject string) *nats.Msg {
	m := nats.NewMsg(subject)
	m.Header.Set("KV-Operation", "PURGE")
	m.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupSubject)
	return m
}

func scanAll(t *testing.T, ctx context.Context, js jetstream.JetStream) map[string]scanned {
	t.Helper()
	got := map[string]scanned{}
	var prev uint64
	err := scanLast(ctx, js, "KV_scan", "$KV.scan.>", func(s scanned) error {
		if _, twice := got[s.subject]; twice {
			t.Errorf("%s delivered twice", s.subject)
		}
		if s.seq <= prev {
			t.Errorf("%s at %d delivered after %d", s.subject, s.seq, prev)
		}
		got[s.subject], prev = s, s.seq
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// A release the leader acknowledged and the copy the consumer reads has
// not stored yet is seen: the key shows its purge marker, not the record.
func TestScanSeesWhatALaggingCopyLacks(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l := lagging(t, ctx, 2,
		&nats.Msg{Subject: "$KV.scan.member.a", Data: []byte("a")},
		&nats.Msg{Subject: "$KV.scan.member.b", Data: []byte("b")},
		purge("$KV.scan.member.a"),
		&nats.Msg{Subject: "$KV.scan.member.c", Data: []byte("c")},
	)
	got := scanAll(t, ctx, l)
	if a := got["$KV.scan.member.a"]; !a.marker {
		t.Errorf("member a, released before the scan, shows %q at %d", a.data, a.seq)
	}
	if b := got["$KV.scan.member.b"]; string(b.data) != "b" {
		t.Errorf("member b shows %q", b.data)
	}
	if c := got["$KV.scan.member.c"]; string(c.data) != "c" {
		t.Errorf("member c, written before the scan, shows %q", c.data)
	}
}

// A copy that holds none of the writes yet (a peer catching up) still
// gives every key, read from the leader.
func TestScanOfACopyFarBehind(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var writes []*nats.Msg
	for i := range 3000 {
		writes = append(writes, &nats.Msg{Subject: "$KV.scan.partition." + strconv.Itoa(i), Data: []byte("x")})
	}
	l := lagging(t, ctx, 0, writes...)
	if got := scanAll(t, ctx, l); len(got) != 3000 {
		t.Errorf("%d keys of 3000", len(got))
	}
}

// When the leader holds nothing, a copy's stale records are not shown.
func TestScanOfAnEmptyLeader(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l := lagging(t, ctx, 1, &nats.Msg{Subject: "$KV.scan.member.a", Data: []byte("a")})
	// The leader's record goes, as an expired marker leaves it.
	s, err := l.JetStream.Stream(ctx, "KV_scan")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	if got := scanAll(t, ctx, l); len(got) != 0 {
		t.Errorf("the scan shows %v of a leader that holds nothing", got)
	}
}
