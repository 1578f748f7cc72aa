package streamsink

import (
	"context"
	"fmt"

	"github.com/leasehold/leasehold"
)

// A dead letter replayed into the log (`leasehold dlq replay --sink`,
// which marks it with leasehold.HeaderReplayOf) is fenced like any
// effect: once its fence has moved on (the partition changed hands since
// the effect was admitted), it is stale, and applying it now could
// overwrite what the new holder wrote. Refused, it would be gone: its
// dead letter was deleted when it was replayed. So a replayed effect the
// fence refuses goes back to the dead-letter stream, with the refusal as
// its error, where the operator sees it (`leasehold dlq list --sink`) and
// decides: apply it by hand, or run its job again under the new holder.

// replayed reports whether a log message is a replayed dead letter.
func replayed(h map[string][]string) bool {
	_, ok := headerGet(h, leasehold.HeaderReplayOf)
	return ok
}

// refileAll sends back to the dead-letter stream the replayed dead letters
// of outs that the fence refused.
func (r *Runner) refileAll(ctx context.Context, outs []outcome) error {
	for i := range outs {
		o := &outs[i]
		if o.refile == nil {
			continue
		}
		cause := fmt.Errorf("replay refused (%s): its fence moved on since the effect was admitted; a dead letter again, to apply by hand or run its job again: %w", o.d.Outcome, o.refile)
		if err := r.deadLetter(ctx, o, 0, cause); err != nil {
			return err
		}
		o.report = true
		o.d.Err = fmt.Errorf("streamsink: the replayed dead letter at log position %d (subject %s, key %q) is back in the dead-letter stream %s: %w",
			o.m.seq, o.m.subject, o.d.Stamp.Key, r.cfg.DeadLetter, cause)
	}
	return nil
}
