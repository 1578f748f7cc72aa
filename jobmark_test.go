package leasehold_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

// final returns the headers of a final of job 7, attempt 1, with extra
// headers added.
func final(extra ...string) map[string][]string {
	h := map[string][]string{
		leasehold.HeaderJob:     {"7"},
		leasehold.HeaderAttempt: {"1"},
		leasehold.HeaderEffects: {"2"},
		leasehold.HeaderAfter:   {"5"},
	}
	for i := 0; i+1 < len(extra); i += 2 {
		h[extra[i]] = append(h[extra[i]], extra[i+1])
	}
	return h
}

func TestJobMarkFloorRead(t *testing.T) {
	good := []struct {
		name string
		h    map[string][]string
		want leasehold.JobMark
	}{
		{"no floor", final(), leasehold.JobMark{Job: 7, Attempt: 1, Effects: 2, After: 5}},
		{"floor", final(leasehold.HeaderFloor, "6"), leasehold.JobMark{Job: 7, Attempt: 1, Effects: 2, After: 5, Floor: 6, Floored: true}},
		{"floor 0", final(leasehold.HeaderFloor, "0"), leasehold.JobMark{Job: 7, Attempt: 1, Effects: 2, After: 5, Floored: true}},
		{"any case, said twice alike", final("leasehold-FLOOR", "3", "Leasehold-Floor", "3"), leasehold.JobMark{Job: 7, Attempt: 1, Effects: 2, After: 5, Floor: 3, Floored: true}},
	}
	for _, c := range good {
		m, err := leasehold.JobMarkFromHeader(c.h)
		if err != nil || m != c.want {
			t.Errorf("%s: %+v, %v; want %+v", c.name, m, err, c.want)
		}
	}
	// Out of order, the job completed before this one on the subject may
	// be a later one: with a floor, After is anything but the job itself.
	h := final(leasehold.HeaderFloor, "2")
	h[leasehold.HeaderAfter] = []string{"9"}
	if m, err := leasehold.JobMarkFromHeader(h); err != nil || m.After != 9 || !m.Floors() {
		t.Errorf("After above the job beside a floor: %+v, %v", m, err)
	}

	bad := []struct {
		name, header string
		h            map[string][]string
	}{
		{"floor at the job", leasehold.HeaderFloor, final(leasehold.HeaderFloor, "7")},
		{"floor above the job", leasehold.HeaderFloor, final(leasehold.HeaderFloor, "8")},
		{"leading zero", leasehold.HeaderFloor, final(leasehold.HeaderFloor, "06")},
		{"sign", leasehold.HeaderFloor, final(leasehold.HeaderFloor, "+6")},
		{"empty", leasehold.HeaderFloor, final(leasehold.HeaderFloor, "")},
		{"space", leasehold.HeaderFloor, final(leasehold.HeaderFloor, "6 ")},
		{"too big", leasehold.HeaderFloor, final(leasehold.HeaderFloor, "18446744073709551616")},
		{"two values", leasehold.HeaderFloor, final(leasehold.HeaderFloor, "3", "leasehold-floor", "4")},
		{"on an effect that is no final", leasehold.HeaderFloor, map[string][]string{
			leasehold.HeaderJob: {"7"}, leasehold.HeaderAttempt: {"1"}, leasehold.HeaderFloor: {"3"}}},
		{"on an abort marker", leasehold.HeaderAbort, map[string][]string{
			leasehold.HeaderJob: {"7"}, leasehold.HeaderAttempt: {"1"}, leasehold.HeaderAbort: {"1"}, leasehold.HeaderFloor: {"3"}}},
		{"After the job itself", leasehold.HeaderAfter, func() map[string][]string {
			h := final(leasehold.HeaderFloor, "3")
			h[leasehold.HeaderAfter] = []string{"7"}
			return h
		}()},
		{"After above the job without a floor", leasehold.HeaderAfter, func() map[string][]string {
			h := final()
			h[leasehold.HeaderAfter] = []string{"9"}
			return h
		}()},
	}
	for _, c := range bad {
		m, err := leasehold.JobMarkFromHeader(c.h)
		var je *leasehold.JobMarkError
		if !errors.As(err, &je) || !errors.Is(err, leasehold.ErrBadJobMark) || je.Header != c.header || m != (leasehold.JobMark{}) {
			t.Errorf("%s: %+v, %v; want a JobMarkError on %s", c.name, m, err, c.header)
		}
	}
}

func TestJobMarkFloorWrite(t *testing.T) {
	cases := []struct {
		m    leasehold.JobMark
		want string // the floor written, "" for none
	}{
		{leasehold.JobMark{Job: 7, Attempt: 1, Effects: 1, After: 5}, ""},
		{leasehold.JobMark{Job: 7, Attempt: 1, Effects: 1, After: 5, Floor: 4}, "4"},
		{leasehold.JobMark{Job: 7, Attempt: 1, Effects: 1, After: 9, Floored: true}, "0"},
		{leasehold.JobMark{Job: 7, Attempt: 1, Floor: 4, Floored: true}, ""},              // no final
		{leasehold.JobMark{Job: 7, Attempt: 1, Abort: true, Floor: 4, Floored: true}, ""}, // no effect
	}
	for _, c := range cases {
		h := map[string][]string{leasehold.HeaderFloor: {"stale"}}
		c.m.SetHeader(h)
		if got := strings.Join(h[leasehold.HeaderFloor], ","); got != c.want {
			t.Errorf("%+v wrote floor %q; want %q", c.m, got, c.want)
		}
		back, err := leasehold.JobMarkFromHeader(h)
		if err != nil {
			t.Errorf("%+v: %v", c.m, err)
			continue
		}
		if back.Floors() != (c.want != "") || (c.want != "" && (back.Floor != c.m.Floor || back.After != c.m.After)) {
			t.Errorf("%+v read back as %+v", c.m, back)
		}
	}
}
