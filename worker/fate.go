package worker

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/internal/leader"
)

// finished tells what became of jobs all of whose partitions' progress has
// passed them: done, dead-lettered (a dead letter is stored before
// progress moves past its job), replayed or purged (a record is stored
// before the dead letter is deleted), or removed unrun (a record is
// stored before progress passes the range). It reads each partition's
// dead letters and records once, from the time of its oldest job in sts.
func (p *Producer) finished(ctx context.Context, sts ...*JobStatus) error {
	byPart := map[leasehold.Partition][]*JobStatus{}
	for _, st := range sts {
		st.State = JobDone
		byPart[st.Partition] = append(byPart[st.Partition], st)
	}
	for part, jobs := range byPart {
		if err := p.partitionFates(ctx, part, jobs); err != nil {
			return err
		}
	}
	return nil
}

// deadLetterSeen is a dead letter of a job, as a scan found it.
type deadLetterSeen struct {
	seq uint64 // in the dead-letter stream
	err string
}

// recordSeen is a record, with its sequence and time in the dead-letter
// stream.
type recordSeen struct {
	Record
	seq  uint64
	time time.Time
}

func (p *Producer) partitionFates(ctx context.Context, part leasehold.Partition, jobs []*JobStatus) error {
	want := make(map[string]*JobStatus, len(jobs))
	oldest := jobs[0].Seq
	for _, st := range jobs {
		want[strconv.FormatUint(st.Seq, 10)] = st
		oldest = min(oldest, st.Seq)
	}
	// Dead letters and records are stored after their jobs: read from a
	// second before the oldest job's time, or from the start when it is
	// gone.
	cc := jetstream.ConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy}
	if s, err := p.jobs(ctx); err == nil {
		if m, err := s.GetMsg(ctx, oldest); err == nil {
			cc = jetstream.ConsumerConfig{DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: ptr(m.Time.Add(-time.Second))}
		}
	}
	dead := map[*JobStatus]deadLetterSeen{}
	err := scan(ctx, p.js, DLQStream(p.cfg.Prefix), DLQSubject(p.cfg.Prefix, part), cc,
		func(m jetstream.Msg, md *jetstream.MsgMetadata) bool {
			if st, ok := want[m.Headers().Get(HeaderSeq)]; ok {
				// The latest, should a job have two.
				dead[st] = deadLetterSeen{seq: md.Sequence.Stream, err: m.Headers().Get(HeaderError)}
			}
			return true
		})
	if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("worker: look for the dead letters of partition %d: %w", part, err)
	}
	fates := map[*JobStatus][]recordSeen{}
	var removed []recordSeen
	err = scanFull(ctx, p.js, DLQStream(p.cfg.Prefix), RecordSubject(p.cfg.Prefix, part), cc,
		func(m jetstream.Msg, md *jetstream.MsgMetadata) bool {
			r, err := ParseRecord(p.cfg.Prefix, m.Subject(), m.Data())
			if err != nil {
				return true // not ours, or garbled: it says nothing
			}
			rs := recordSeen{Record: r, seq: md.Sequence.Stream, time: md.Timestamp}
			if r.Kind == RecordRemoved {
				removed = append(removed, rs)
			} else if st, ok := want[strconv.FormatUint(r.Seq, 10)]; ok && r.DeadLetter < rs.seq {
				// A record stored before the dead letter it names is
				// not about it.
				fates[st] = append(fates[st], rs)
			}
			return true
		})
	if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("worker: look for the records of partition %d: %w", part, err)
	}
	for _, st := range jobs {
		dl, isDead := dead[st]
		if rs, ok, err := p.fateOf(ctx, fates[st]); err != nil {
			return err
		} else if ok && (!isDead || dl.seq < rs.seq) {
			st.DeadLetter, st.Error = rs.DeadLetter, rs.Reason
			if rs.Kind == RecordReplayed {
				st.State, st.ReplayedAs = JobReplayed, rs.As
			} else {
				st.State = JobPurged
			}
			continue
		}
		if isDead {
			st.State, st.Error, st.DeadLetter = JobDeadLettered, dl.err, dl.seq
			continue
		}
		if !st.removed {
			continue // done
		}
		for _, r := range removed {
			if r.From <= st.Seq && st.Seq <= r.To {
				st.State, st.Detail = JobRemovedUnrun, fmt.Sprintf("the job stream removed it before it ran (aged out): its partition's worker found sequences %d to %d gone", r.From, r.To)
				break
			}
		}
	}
	return nil
}

// fateOf is the latest of a job's replayed and purged records (in stream
// order) that holds: the dead letter it names is gone (a record is stored
// before its dead letter is deleted, so one whose dead letter is still
// there is of a replay or purge that has not finished, or failed), and a
// replay's job, while the job stream holds it, is on the partition the
// record names and says it replays that dead letter.
func (p *Producer) fateOf(ctx context.Context, recs []recordSeen) (recordSeen, bool, error) {
	dlq := leader.NewReader(p.js, DLQStream(p.cfg.Prefix))
	for i := len(recs) - 1; i >= 0; i-- {
		r := recs[i]
		if r.DeadLetterTime.After(r.time) {
			continue // names a dead letter stored after itself
		}
		m, err := dlq.Next(ctx, r.DeadLetter, "")
		if err != nil {
			return recordSeen{}, false, fmt.Errorf("worker: check the dead letter a record names: %w", err)
		}
		if m != nil && m.Seq == r.DeadLetter {
			continue
		}
		if r.Kind == RecordReplayed {
			ok, err := p.isReplay(ctx, r)
			if err != nil {
				return recordSeen{}, false, err
			}
			if !ok {
				continue
			}
		}
		return r, true, nil
	}
	return recordSeen{}, false, nil
}

// isReplay reports whether the job r.As names is the replay of r's dead
// letter, or is no longer in the job stream to say otherwise.
func (p *Producer) isReplay(ctx context.Context, r recordSeen) (bool, error) {
	as, err := ParseRef(r.As)
	if err != nil {
		return false, nil
	}
	m, err := leader.NewReader(p.js, JobsStream(p.cfg.Prefix)).Next(ctx, as.Seq, "")
	if err != nil {
		return false, fmt.Errorf("worker: check the job a replay record names: %w", err)
	}
	if m == nil || m.Seq != as.Seq {
		return true, nil // trimmed since, or aged out
	}
	return m.Subject == JobSubject(p.cfg.Prefix, as.Partition) &&
		firstValue(m.Header, leasehold.HeaderReplayOf) == ReplayOf(DLQStream(p.cfg.Prefix), r.DeadLetter), nil
}

// ReplayOf is the value of leasehold.HeaderReplayOf on the replay of the
// dead letter at seq of stream: "<stream>/<seq>".
func ReplayOf(stream string, seq uint64) string {
	return stream + "/" + strconv.FormatUint(seq, 10)
}
