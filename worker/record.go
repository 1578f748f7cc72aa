package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/jspub"
	"github.com/leasehold/leasehold/internal/leader"
)

// Records say what became of jobs that did not simply run: a dead letter
// replayed or purged by `leasehold dlq`, and jobs the worker found removed
// from the job stream before they ran. They are small JSON messages in the
// dead-letter stream, on "<prefix>.dlq.record.<p>" (which the stream's
// "<prefix>.dlq.>" holds already, so no stream changes), written before the
// dead letter is deleted or before progress passes the removed jobs, and
// read by Producer.Status and Producer.Wait through the stream leader.
//
// Anyone allowed to publish on the dead-letter stream can write one, as
// they can write a dead letter. A record is read only for a job its
// partition's committed progress has passed, so no record, forged or not,
// makes a pending job look finished; a replayed or purged record counts
// only once the dead letter it names is gone, and a replayed one only if
// the job it names (while the job stream holds it) is that dead letter's
// replay. What a forger can still do is have a job that finished report
// purged, replayed or removed: what a forged dead letter could do already
// (report it dead-lettered). Our own tool sending a record again (a replay
// or purge retried after a failure) sends the same bytes under the same
// message ID: the stream stores it once within its duplicate window, and
// after it a second copy says the same.

// RecordKind says what a record records.
type RecordKind string

// Record kinds.
const (
	// RecordReplayed: the dead letter was replayed as the job As.
	RecordReplayed RecordKind = "replayed"
	// RecordPurged: the dead letter was purged; the job will not run.
	RecordPurged RecordKind = "purged"
	// RecordRemoved: the partition's jobs from From to To were removed
	// from the job stream (aged out) before they ran.
	RecordRemoved RecordKind = "removed"
)

// Record is one record. Seq, DeadLetter, DeadLetterTime, Origin, Reason
// and As describe a dead letter's fate; From and To a removed range.
type Record struct {
	Kind      RecordKind          `json:"record"`
	Partition leasehold.Partition `json:"partition"`
	// Seq is the dead-lettered job's sequence in the job stream: the
	// place its status is asked for.
	Seq uint64 `json:"seq,omitempty"`
	// Origin is the job's identity (leasehold.Origin.String).
	Origin string `json:"origin,omitempty"`
	// DeadLetter is the dead letter's sequence in the dead-letter stream,
	// and DeadLetterTime when it was stored there.
	DeadLetter     uint64    `json:"dead_letter,omitempty"`
	DeadLetterTime time.Time `json:"dead_letter_time,omitzero"`
	// Reason is the failure the dead letter carried.
	Reason string `json:"reason,omitempty"`
	// As is the replay's reference (Enqueued.Ref) for RecordReplayed.
	As string `json:"as,omitempty"`
	// From and To bound the removed range of RecordRemoved.
	From uint64 `json:"from,omitempty"`
	To   uint64 `json:"to,omitempty"`
}

// maxRecord bounds a record's JSON: what a reader reads of one.
const maxRecord = 4096

// maxRecordReason bounds Record.Reason.
const maxRecordReason = 512

// RecordSubject is the subject of partition p's records:
// "<prefix>.dlq.record.<p>".
func RecordSubject(prefix string, p leasehold.Partition) string {
	return prefix + ".dlq.record." + p.String()
}

// IsRecordSubject reports whether subject is one of the record subjects of
// prefix: a message there is no dead letter.
func IsRecordSubject(prefix, subject string) bool {
	rest, ok := strings.CutPrefix(subject, prefix+".dlq.record.")
	if !ok {
		return false
	}
	_, err := leasehold.ParsePartition(rest)
	return err == nil
}

// Validate reports what makes r unreadable.
func (r Record) Validate() error {
	if r.Partition >= leasehold.MaxPartitions {
		return fmt.Errorf("partition %d is not below %d", r.Partition, leasehold.MaxPartitions)
	}
	switch r.Kind {
	case RecordReplayed, RecordPurged:
		if r.Seq == 0 || r.DeadLetter == 0 {
			return errors.New("names no job or no dead letter")
		}
		if r.From != 0 || r.To != 0 {
			return errors.New("a dead letter's record names a removed range")
		}
		if _, err := leasehold.ParseOrigin(r.Origin); err != nil {
			return err
		}
		if len(r.Reason) > maxRecordReason {
			return fmt.Errorf("its reason is longer than %d bytes", maxRecordReason)
		}
		if r.Kind == RecordPurged {
			if r.As != "" {
				return errors.New("a purge names a replay")
			}
			return nil
		}
		as, err := ParseRef(r.As)
		if err != nil {
			return err
		}
		if !as.Due.IsZero() {
			return errors.New("a replay is stored at once, never delayed")
		}
	case RecordRemoved:
		if r.From == 0 || r.To < r.From {
			return fmt.Errorf("removed range %d to %d is empty", r.From, r.To)
		}
		if r.Seq != 0 || r.DeadLetter != 0 || r.As != "" || r.Origin != "" || r.Reason != "" {
			return errors.New("a removed range names a dead letter")
		}
	default:
		return fmt.Errorf("unknown kind %q", r.Kind)
	}
	return nil
}

// Msg is r as the message to publish in the dead-letter stream of prefix.
// Its Nats-Msg-Id is derived from what it records, so that the stream
// stores a record sent again once (within its duplicate window).
func (r Record) Msg(prefix string) (*nats.Msg, error) {
	if err := r.Validate(); err != nil {
		return nil, fmt.Errorf("worker: record: %w", err)
	}
	data, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	msg := nats.NewMsg(RecordSubject(prefix, r.Partition))
	msg.Data = data
	id := prefix + "." + r.Partition.String() + "." + string(r.Kind) + "."
	if r.Kind == RecordRemoved {
		id += strconv.FormatUint(r.From, 10) + "-" + strconv.FormatUint(r.To, 10)
	} else {
		id += strconv.FormatUint(r.DeadLetter, 10) + "@" + strconv.FormatInt(r.DeadLetterTime.UnixNano(), 10)
		if r.As != "" {
			id += ">" + r.As
		}
	}
	msg.Header.Set(jetstream.MsgIDHeader, id)
	return msg, nil
}

// recordTimeout bounds StoreRecord under a context without a deadline.
const recordTimeout = 10 * time.Second

// StoreRecord stores r in the dead-letter stream of prefix and waits for
// the acknowledgement (at most ten seconds, under a context without a
// deadline). A duplicate acknowledgement is checked by reading
// the stored message through the stream leader: it says only that some
// message with the record's ID is stored, and anyone who may publish there
// can take an ID first; a record pre-empted so is stored again under an ID
// of its own. It returns the record's sequence in the dead-letter stream.
func StoreRecord(ctx context.Context, js jetstream.JetStream, prefix string, r Record) (uint64, error) {
	msg, err := r.Msg(prefix)
	if err != nil {
		return 0, err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, recordTimeout)
		defer cancel()
	}
	stream := DLQStream(prefix)
	for try := 0; try < 2; try++ {
		ack, err := jspub.Publish(ctx, js, msg, jetstream.WithExpectStream(stream))
		if err != nil {
			return 0, fmt.Errorf("worker: store the %s record of partition %d in %s: %w", r.Kind, r.Partition, stream, err)
		}
		if !ack.Duplicate {
			return ack.Sequence, nil
		}
		stored, err := leader.NewReader(js, stream).Next(ctx, ack.Sequence, "")
		if err != nil {
			return 0, fmt.Errorf("worker: confirm the %s record of partition %d: %w", r.Kind, r.Partition, err)
		}
		if stored != nil && stored.Seq == ack.Sequence && stored.Subject == msg.Subject && bytes.Equal(stored.Data, msg.Data) {
			return ack.Sequence, nil // stored by an earlier try
		}
		msg.Header.Set(jetstream.MsgIDHeader, msg.Header.Get(jetstream.MsgIDHeader)+"~"+newNonce())
	}
	return 0, fmt.Errorf("worker: the %s record of partition %d was answered as a duplicate of another message twice", r.Kind, r.Partition)
}

// ParseRecord reads a record stored on subject, strictly: a record
// subject of prefix, JSON within bounds, valid, and of the subject's
// partition.
func ParseRecord(prefix, subject string, data []byte) (Record, error) {
	if !IsRecordSubject(prefix, subject) {
		return Record{}, fmt.Errorf("worker: %s is not a record subject of %s", subject, prefix)
	}
	if len(data) > maxRecord {
		return Record{}, fmt.Errorf("worker: record on %s: %d bytes, above the %d a record takes", subject, len(data), maxRecord)
	}
	var r Record
	if err := json.Unmarshal(data, &r); err != nil {
		return Record{}, fmt.Errorf("worker: record on %s: %w", subject, err)
	}
	if err := r.Validate(); err != nil {
		return Record{}, fmt.Errorf("worker: record on %s: %w", subject, err)
	}
	if RecordSubject(prefix, r.Partition) != subject {
		return Record{}, fmt.Errorf("worker: record on %s names partition %d", subject, r.Partition)
	}
	return r, nil
}
