package leasehold_test

import (
	"errors"
	"testing"

	"github.com/leasehold/leasehold"
)

// A forger writes stamps and marks in the compact form by hand, with
// everything a hand can get wrong or slip in: spaces out of place, signs,
// leading zeros, numbers past their bounds, non-ASCII digits and letters,
// control bytes, header names in other cases, a header given twice, and a
// compact header beside a per-field one that says something else. Each
// must be refused with an error that names the header (ErrBadStamp,
// ErrBadJobMark), never read as some other stamp or mark.
func TestAttackCompactStampRefused(t *testing.T) {
	for _, v := range []string{
		"",
		"1",
		"1 ",
		"1 s 0 5 a",       // no key
		"1  s 0 5 a k",    // two spaces
		"1 s 0 5 a  k",    // two spaces before the key
		"1 s 0 5 a k ",    // a trailing space
		" 1 s 0 5 a k",    // a leading space
		"1\ts 0 5 a k",    // a tab for a space
		"1 s 0 5 a k\tw",  // a tab inside
		"1 s 0 5 a k w x", // a seventh field
		"2 s 0 5 a k",     // another version
		"01 s 0 5 a k",    // the version with a leading zero
		"1 s 00 5 a k",    // leading zeros
		"1 s 0 05 a k",    //
		"1 s 0 -5 a k",    // signs
		"1 s 0 +5 a k",    //
		"1 s -0 5 a k",    //
		"1 s 0 0 a k",     // epoch zero
		"1 s 65536 5 a k", // partition past its bound
		"1 s 0 9223372036854775808 a k",
		"1 s 0 18446744073709551616 a k",
		"1 s 0 99999999999999999999999999 a k",
		"1 s 0 ５ a k",     // full-width digits
		"1 s ０ 5 a k",     //
		"1 sé 0 5 a k",    // non-ASCII where ASCII is required
		"1 s 0 5 aé k",    //
		"1 s 0 5 a k wé",  //
		"1 s 0 5 a k\x00", // control bytes
		"1 s 0 5 a k\r\nLeasehold-Epoch: 9",
		"1 s 0 5 a k\x7f",
	} {
		if st, err := leasehold.ParseStamp(v); err == nil || !errors.Is(err, leasehold.ErrBadStamp) {
			t.Errorf("ParseStamp(%q) = %+v, %v: want an error matching ErrBadStamp", v, st, err)
		}
		if st, err := leasehold.StampFromHeader(map[string][]string{leasehold.HeaderStamp: {v}}); err == nil || !errors.Is(err, leasehold.ErrBadStamp) {
			t.Errorf("StampFromHeader(%s: %q) = %+v, %v: want an error matching ErrBadStamp", leasehold.HeaderStamp, v, st, err)
		}
	}
	const good = "1 s 0 5 a k w"
	for name, h := range map[string]map[string][]string{
		"twice, disagreeing":            {leasehold.HeaderStamp: {good, "1 s 0 6 a k w"}},
		"two spellings, disagreeing":    {leasehold.HeaderStamp: {good}, "leasehold-stamp": {"1 s 0 6 a k w"}},
		"beside a legacy epoch":         {leasehold.HeaderStamp: {good}, "leasehold-epoch": {"5"}},
		"beside a legacy epoch, higher": {"LEASEHOLD-STAMP": {good}, leasehold.HeaderEpoch: {"9"}},
		"beside a legacy worker only":   {leasehold.HeaderStamp: {good}, leasehold.HeaderWorker: {"w"}},
		"beside a whole legacy stamp": {leasehold.HeaderStamp: {good}, leasehold.HeaderScope: {"s"}, leasehold.HeaderPartition: {"0"},
			leasehold.HeaderEpoch: {"5"}, leasehold.HeaderAcquisition: {"a"}, leasehold.HeaderKey: {"k"}},
	} {
		if st, err := leasehold.StampFromHeader(h); err == nil || !errors.Is(err, leasehold.ErrBadStamp) {
			t.Errorf("%s: StampFromHeader = %+v, %v: want an error matching ErrBadStamp", name, st, err)
		}
		if !leasehold.HasStamp(h) {
			t.Errorf("%s: HasStamp = false", name)
		}
	}
	// The same stamp under two spellings, or given twice, is one stamp.
	for _, h := range []map[string][]string{
		{"LEASEHOLD-STAMP": {good}},
		{leasehold.HeaderStamp: {good}, "leasehold-stamp": {good}},
		{leasehold.HeaderStamp: {good, good}},
	} {
		st, err := leasehold.StampFromHeader(h)
		if err != nil || st != (leasehold.Stamp{Scope: "s", Epoch: 5, Acquisition: "a", Key: "k", Worker: "w"}) {
			t.Errorf("StampFromHeader(%v) = %+v, %v", h, st, err)
		}
	}
}

// The same for the compact job mark, with the forged markers a forger
// would want: a final that counts no effects or names the job itself, an
// abort that also counts effects, a floor that is not below its job.
func TestAttackCompactMarkRefused(t *testing.T) {
	for _, v := range []string{
		"",
		"1",
		"1 5",                   // no attempt
		"1 0 1",                 // job zero
		"1 5 0",                 // attempt zero
		"1 5 1 ",                // a trailing space
		"1 5  1",                // two spaces
		"1  5 1",                //
		"1 5 1 ABORT",           // the marker's word in another case
		"1 5 1 Abort",           //
		"1 5 1 abort ",          //
		"1 5 1 abort 1",         // an abort that counts effects
		"1 5 1 abort 1 2",       //
		"1 5 1 1 abort",         //
		"1 5 1 2",               // a final without its after
		"1 5 1 0 4",             // a final of no effects
		"1 5 1 2 5",             // after naming the job itself
		"1 5 1 2 6",             // after past the job, without a floor
		"1 5 1 2 5 3",           // after naming the job itself, with a floor
		"1 5 1 2 4 5",           // a floor not below the job
		"1 5 1 2 4 9",           //
		"1 5 1 2 4 3 1",         // a seventh field
		"1 5 1 2 04",            // leading zeros
		"1 05 1",                //
		"1 5 01",                //
		"1 5 1 -2 4",            // signs
		"1 +5 1",                //
		"1 5 1 2 -1",            //
		"1 5 99999999999999999", // past the attempt's bound
		"1 18446744073709551616 1",
		"1 5 1 2 18446744073709551616",
		"1 5 1 99999999 4", // past the effects' bound
		"1 ５ 1",            // full-width digits
		"1 5 1\x00",        // control bytes
		"1 5 1\r\nLeasehold-Abort: 1",
		"2 5 1",  // another version
		"1\t5 1", //
	} {
		if m, err := leasehold.ParseJobMark(v); err == nil || !errors.Is(err, leasehold.ErrBadJobMark) {
			t.Errorf("ParseJobMark(%q) = %+v, %v: want an error matching ErrBadJobMark", v, m, err)
		}
		if m, err := leasehold.JobMarkFromHeader(map[string][]string{leasehold.HeaderMark: {v}}); err == nil || !errors.Is(err, leasehold.ErrBadJobMark) {
			t.Errorf("JobMarkFromHeader(%s: %q) = %+v, %v: want an error matching ErrBadJobMark", leasehold.HeaderMark, v, m, err)
		}
	}
	for name, h := range map[string]map[string][]string{
		"an effect, and a final in another spelling": {leasehold.HeaderMark: {"1 5 1"}, "leasehold-mark": {"1 5 1 2 4"}},
		"twice, disagreeing":                         {leasehold.HeaderMark: {"1 5 1", "1 5 1 abort"}},
		"beside a legacy abort":                      {leasehold.HeaderMark: {"1 5 1 2 4"}, "LEASEHOLD-ABORT": {"1"}},
		"beside the same legacy job":                 {leasehold.HeaderMark: {"1 5 1"}, leasehold.HeaderJob: {"5"}},
		"beside a legacy floor":                      {leasehold.HeaderMark: {"1 5 1 2 4"}, leasehold.HeaderFloor: {"3"}},
		"beside a legacy final of another attempt": {leasehold.HeaderMark: {"1 5 1"}, leasehold.HeaderJob: {"5"}, leasehold.HeaderAttempt: {"2"},
			leasehold.HeaderEffects: {"1"}, leasehold.HeaderAfter: {"4"}},
	} {
		if m, err := leasehold.JobMarkFromHeader(h); err == nil || !errors.Is(err, leasehold.ErrBadJobMark) {
			t.Errorf("%s: JobMarkFromHeader = %+v, %v: want an error matching ErrBadJobMark", name, m, err)
		}
	}
}
