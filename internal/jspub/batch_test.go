package jspub_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/testing/natstest"
)

// casMsgs are writes to s.<key> expecting each key's last sequence.
func casMsgs(expect map[string]uint64, keys ...string) []*nats.Msg {
	msgs := make([]*nats.Msg, len(keys))
	for i, k := range keys {
		m := nats.NewMsg("s." + k)
		m.Data = []byte(k)
		m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(expect[k], 10))
		msgs[i] = m
	}
	return msgs
}

// A committed batch is stored whole, in order, at consecutive sequences
// ending at the one its answer names; a batch with one failed
// compare-and-set is refused with the server's API error and stores
// nothing; a stream without atomic publish refuses every batch.
func TestBatchStoresAllOrNothingAtConsecutiveSequences(t *testing.T) {
	t.Parallel()
	s := natstest.Start(t)
	js := s.JetStream(t)
	nc := s.Connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, AllowAtomicPublish: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.other", nil); err != nil {
		t.Fatal(err)
	}
	keys := []string{"a", "b", "c", "d"}
	ack, err := jspub.Batch(ctx, nc, casMsgs(nil, keys...))
	if err != nil {
		t.Fatal(err)
	}
	if ack.Stream != "S" || ack.Count != len(keys) || ack.Seq != 5 {
		t.Fatalf("answer %+v, want stream S, 4 messages ending at 5", ack)
	}
	for i, k := range keys {
		m, err := st.GetLastMsgForSubject(ctx, "s."+k)
		if err != nil {
			t.Fatal(err)
		}
		if want := ack.Seq - uint64(len(keys)-1-i); m.Sequence != want || string(m.Data) != k {
			t.Errorf("s.%s: %q at %d, want %q at %d", k, m.Data, m.Sequence, k, want)
		}
	}

	// b is at 3, not 0: the whole batch is refused.
	_, err = jspub.Batch(ctx, nc, casMsgs(map[string]uint64{"e": 0, "b": 0}, "e", "b"))
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || (apiErr.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequence && apiErr.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequenceConstant) {
		t.Fatalf("batch with a stale compare-and-set: %v, want a wrong-last-sequence API error", err)
	}
	if _, err := st.GetLastMsgForSubject(ctx, "s.e"); !errors.Is(err, jetstream.ErrMsgNotFound) {
		t.Errorf("s.e after the refused batch: %v, want nothing stored", err)
	}

	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg("t.a")
	_, err = jspub.Batch(ctx, nc, []*nats.Msg{m})
	if !errors.As(err, &apiErr) || apiErr.ErrorCode != 10174 {
		t.Fatalf("batch to a stream without atomic publish: %v, want API error 10174", err)
	}
}
