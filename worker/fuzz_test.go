package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/worker"
)

type fuzzOrder struct {
	ID    string            `json:"id"`
	Qty   int               `json:"qty"`
	Tags  []string          `json:"tags"`
	Attrs map[string]string `json:"attrs"`
}

// FuzzJSONJob: whatever payload a job carries, worker.JSON either hands
// the handler the decoded value or fails the job permanently (it is
// dead-lettered at once: retrying cannot fix a payload) with an error that
// names the job; it never panics and never calls the handler with a value
// that did not decode.
func FuzzJSONJob(f *testing.F) {
	f.Add([]byte(`{"id":"a","qty":2,"tags":["x"],"attrs":{"k":"v"}}`))
	f.Add([]byte(`{"qty":"two"}`))
	f.Add([]byte(`null`))
	f.Add([]byte(``))
	f.Add([]byte(`{"id":"\ud800"}`))
	f.Add([]byte("\xff\xfe{"))
	f.Add([]byte(`[1,2,3]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		called := false
		var got fuzzOrder
		h := worker.JSON(func(_ context.Context, _ *worker.Job, v fuzzOrder) error {
			called, got = true, v
			return nil
		})
		job := &worker.Job{Data: data, Seq: 7, Partition: 3, Header: nats.Header{}}
		err := h.Handle(context.Background(), job)
		var want fuzzOrder
		werr := json.Unmarshal(data, &want)
		switch {
		case werr == nil && (err != nil || !called):
			t.Fatalf("valid payload %q: handler called %v, error %v", data, called, err)
		case werr == nil:
			gb, _ := json.Marshal(got)
			wb, _ := json.Marshal(want)
			if string(gb) != string(wb) {
				t.Fatalf("decoded %s, want %s", gb, wb)
			}
		case called:
			t.Fatalf("handler called with a payload that does not decode: %q", data)
		case !worker.IsPermanent(err):
			t.Fatalf("undecodable payload: error %v is not permanent", err)
		case !strings.Contains(err.Error(), "job 7 of partition 3"):
			t.Fatalf("error %q does not name the job", err)
		}
	})
}

// FuzzJobStampHeaders: a job's headers may hold anything, an upstream
// stamp included (an effect of another worker group consumed as a job).
// Read back through leasehold.StampFromHeader, they give a valid stamp or
// a StampError, never a partial stamp, and nats.Header's canonical and
// lower-case spellings agree.
func FuzzJobStampHeaders(f *testing.F) {
	f.Add("3", "17", "orders.3.17.0", "w")
	f.Add("", "-1", "", "")
	f.Add("3", "17", "a\nb", "w")
	f.Fuzz(func(t *testing.T, p, e, k, w string) {
		h := nats.Header{}
		h.Set(leasehold.HeaderPartition, p)
		h.Set(leasehold.HeaderEpoch, e)
		h.Set(leasehold.HeaderKey, k)
		h.Set(leasehold.HeaderWorker, w)
		lower := nats.Header{}
		for name, vs := range h {
			lower[strings.ToLower(name)] = vs
		}
		s, err := leasehold.StampFromHeader(h)
		s2, err2 := leasehold.StampFromHeader(lower)
		if s != s2 || (err == nil) != (err2 == nil) {
			t.Fatalf("canonical %+v, %v; lower-case %+v, %v", s, err, s2, err2)
		}
		if err != nil {
			if !errors.Is(err, leasehold.ErrBadStamp) || s != (leasehold.Stamp{}) {
				t.Fatalf("%+v, %v", s, err)
			}
			return
		}
		if err := s.Validate(); err != nil {
			t.Fatal(err)
		}
	})
}
