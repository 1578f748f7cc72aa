package sink

import (
	"fmt"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/telemetry"
)

// A process span's name, kept per subject and partition, is the one made
// for each message before: the subject's template, or the sink's name for
// a message without a subject. A subject longer than maxNameSubject, and
// any past maxNames subjects, are named right and not kept.
func TestProcessNamesKept(t *testing.T) {
	r := NewReporter(ReporterConfig{Name: "orders-sink"})
	check := func(subject string, p leasehold.Partition) {
		t.Helper()
		template := telemetry.SubjectTemplate(subject, p)
		if subject == "" {
			template = "orders-sink"
		}
		want := processName{template: template, name: telemetry.SpanName("process", template)}
		for range 2 { // made, then kept
			if got := r.processName(subject, p); got != want {
				t.Fatalf("processName(%q, %d) = %+v, want %+v", subject, p, got, want)
			}
		}
	}
	check("orders.out.3", 3)
	check("orders.out.3", 4) // the same subject, another partition: no template
	check("orders.out.x", 3)
	check("", 3)
	if got := r.processName("orders.out.3", 3).name; got != "process orders.out.{partition}" {
		t.Fatalf("name %q", got)
	}
	if n := testing.AllocsPerRun(100, func() { r.processName("orders.out.3", 3) }); n != 0 {
		t.Fatalf("a kept name costs %v allocations, want 0", n)
	}
	long := strings.Repeat("x", maxNameSubject) + ".3"
	check(long, 3)
	if _, kept := r.names[nameKey{long, 3}]; kept {
		t.Fatalf("a subject of %d bytes was kept", len(long))
	}
	for i := range maxNames + 10 {
		check(fmt.Sprintf("orders.out.%d", i), leasehold.Partition(i))
	}
	if len(r.names) != maxNames {
		t.Fatalf("the Reporter keeps %d names, want its bound %d", len(r.names), maxNames)
	}
}
