package httpsink

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/leasehold/leasehold"
)

// Codes of a Verifier's refusals, in Refusal.Error.
const (
	// CodeStaleEpoch (409): a newer epoch is recorded for the fence the
	// request was judged on (Fence says which: the relay's, or the
	// effect's for a direct request). Max, MaxAcquisition and Holder say
	// what superseded it.
	CodeStaleEpoch = "stale_epoch"
	// CodeSplitBrain (409): the request's epoch is the recorded one, from
	// another acquisition.
	CodeSplitBrain = "split_brain"
	// CodeUnverified (403): the lease bucket never issued the epoch to the
	// fence (a store with verified epochs).
	CodeUnverified = "unverified_epoch"
	// CodeInProgress (409, Retry-After: 1): a request with the same
	// Idempotency-Key is being handled now; try again.
	CodeInProgress = "in_progress"
	// CodeKeyReused (422): the Idempotency-Key was first used with another
	// method or body.
	CodeKeyReused = "key_reused"
	// CodeMissingStamp (400): no leasehold stamp.
	CodeMissingStamp = "missing_stamp"
	// CodeBadStamp (400): a stamp or relay stamp that does not parse.
	CodeBadStamp = "bad_stamp"
	// CodeMissingRelay (400): the Verifier takes relayed requests only.
	CodeMissingRelay = "missing_relay"
	// CodeMissingKey (400): no Idempotency-Key.
	CodeMissingKey = "missing_key"
	// CodeBadKey (400): an Idempotency-Key that does not parse, or names
	// another effect than the stamp.
	CodeBadKey = "bad_key"
	// CodeTooLarge (413) and CodeTooManyHeaders (431): over the Verifier's
	// bounds.
	CodeTooLarge       = "too_large"
	CodeTooManyHeaders = "too_many_headers"
	// CodeUnavailable (503, Retry-After: 1): the store did not answer.
	CodeUnavailable = "unavailable"
)

// Fences a refusal names.
const (
	FenceRelay  = "relay"
	FenceEffect = "effect"
)

// Refusal is the JSON body of a Verifier's refusals (Content-Type
// application/json). For a stale request it names the fence that refused
// it, the request's epoch and what superseded it.
type Refusal struct {
	Error          string `json:"error"`
	Fence          string `json:"fence,omitempty"`
	Scope          string `json:"scope,omitempty"`
	Partition      uint32 `json:"partition"`
	Epoch          uint64 `json:"epoch,omitempty"`
	Acquisition    string `json:"acquisition,omitempty"`
	Max            uint64 `json:"max,omitempty"`
	MaxAcquisition string `json:"max_acquisition,omitempty"`
	Holder         string `json:"holder,omitempty"`
	Key            string `json:"key,omitempty"`
	Message        string `json:"message"`
}

// staleRefusal describes the refusal of a request judged on fence (one of
// the Fence constants) by e.
func staleRefusal(fence string, e *leasehold.StaleEpochError) Refusal {
	code := CodeStaleEpoch
	if e.SplitBrain {
		code = CodeSplitBrain
	}
	return Refusal{
		Error: code, Fence: fence, Scope: e.Scope, Partition: uint32(e.Partition), Epoch: uint64(e.Epoch),
		Acquisition: e.Acquisition, Max: uint64(e.Max), MaxAcquisition: e.MaxAcquisition, Holder: e.Holder,
		Message: e.Error(),
	}
}

// write sends r with status.
func (r Refusal) write(w http.ResponseWriter, status int) {
	body, _ := json.Marshal(r)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	if status == http.StatusServiceUnavailable || r.Error == CodeInProgress {
		w.Header().Set("Retry-After", "1")
	}
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// maxRefusal bounds the body the relay reads as a Refusal.
const maxRefusal = 8 << 10

// parseRefusal reads a 409's body as a Verifier's Refusal, strictly:
// JSON of the Refusal's fields and no others. ok is false for any other
// body: the receiver's own conflict, not a Verifier's.
func parseRefusal(body []byte) (Refusal, bool) {
	if len(body) == 0 || len(body) > maxRefusal {
		return Refusal{}, false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	var r Refusal
	if err := dec.Decode(&r); err != nil || dec.More() {
		return Refusal{}, false
	}
	switch r.Error {
	case CodeStaleEpoch, CodeSplitBrain, CodeInProgress:
		return r, true
	}
	return Refusal{}, false
}

// supersedes reports whether r says that relay lease l is superseded at
// the receiver: a stale or split-brain refusal on the relay's fence, of
// l's own scope, epoch and acquisition.
func (r Refusal) supersedes(l leasehold.Lease) bool {
	return (r.Error == CodeStaleEpoch || r.Error == CodeSplitBrain) && r.Fence == FenceRelay &&
		r.Scope == l.Scope && r.Partition == 0 && r.Epoch == uint64(l.Epoch) && r.Acquisition == l.Acquisition &&
		(r.Max > uint64(l.Epoch) || r.Error == CodeSplitBrain && r.Max == uint64(l.Epoch))
}

func (r Refusal) String() string {
	s := r.Error
	if r.Fence != "" {
		s += fmt.Sprintf(" on the %s fence %s/%d: epoch %d, recorded %d", r.Fence, r.Scope, r.Partition, r.Epoch, r.Max)
		if r.Holder != "" {
			s += " held by " + r.Holder
		}
	}
	return s
}
