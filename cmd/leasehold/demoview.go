package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/leasehold/leasehold/coordinator"
)

// view refreshes a table on a terminal, or prints a progress line every
// few seconds otherwise, until ctx ends.
func (d *demo) view(ctx context.Context, b *coordinator.Bucket) {
	every := 2 * time.Second
	if d.cfg.live {
		every = 250 * time.Millisecond
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if d.cfg.json {
			continue
		}
		if d.cfg.live {
			d.render(b)
		} else {
			d.mu.Lock()
			line := fmt.Sprintf("%7s  progress: %d of %d jobs enqueued, %d applied, %d zombie writes refused", d.since(), len(d.enqueued), d.cfg.jobs, len(d.applied), len(d.stale))
			d.mu.Unlock()
			fmt.Fprintln(d.out, line)
		}
	}
}

func (d *demo) render(b *coordinator.Bucket) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	st, err := b.Snapshot(ctx)
	var buf bytes.Buffer
	buf.WriteString("\x1b[H\x1b[2J") // home, clear
	fmt.Fprintf(&buf, "leasehold demo — %s of %s   (Ctrl-C stops it)\n\n", d.since(), d.cfg.duration)
	if err != nil {
		fmt.Fprintf(&buf, "reading the lease bucket: %v\n", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	tw := tabwriter.NewWriter(&buf, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PARTITION\tOWNER\tEPOCH\tLEASE AGE\tLAG\t")
	now := time.Now()
	for _, p := range st.Partitions {
		owner, epoch, age := "-", "-", "-"
		if p.Holder != "" {
			owner, epoch, age = p.Holder, shortEpoch(p.Epoch), ago(now, p.Acquired)
			if p.Holder == d.paused {
				owner += " (frozen)"
			}
		}
		lag := 0
		for _, seq := range d.perPart[p.Partition] {
			if seq > p.Progress {
				lag++
			}
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t\n", p.Partition, owner, epoch, age, lag)
	}
	tw.Flush()
	fmt.Fprintf(&buf, "\njobs: %d of %d enqueued, %d applied   zombie writes refused: %d   stale applied: %d\n",
		len(d.enqueued), d.cfg.jobs, len(d.applied), len(d.stale), d.staleApplied)
	if d.paused != "" {
		fmt.Fprintf(&buf, "%s is FROZEN (SIGSTOP) for %v; its leases run out, the others take its partitions with higher epochs\n",
			d.paused, (d.cfg.ttl + 2*time.Second - time.Since(d.pausedAt)).Round(100*time.Millisecond))
	}
	buf.WriteString("\n" + strings.Join(d.events, "\n") + "\n")
	d.out.Write(buf.Bytes())
}
