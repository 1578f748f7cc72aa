package kvsink

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/leasehold/leasehold"
)

func TestScopeToken(t *testing.T) {
	t.Parallel()
	for scope, want := range map[string]string{
		"orders":                 "orders",
		"jobs-a_b":               "jobs-a_b",
		"billing/account:42":     "billing/account=3A42",
		"a.b":                    "a=2Eb",
		"a=2Eb":                  "a=3D2Eb",
		"a=b":                    "a=3Db",
		"*>~@":                   "=2A=3E=7E=40",
		"billing/report.q3:2026": "billing/report=2Eq3=3A2026",
	} {
		got := scopeToken(scope)
		if got != want {
			t.Errorf("scopeToken(%q) = %q, want %q", scope, got, want)
		}
		back, err := parseScopeToken(got)
		if err != nil || back != scope {
			t.Errorf("parseScopeToken(%q) = %q, %v; want %q", got, back, err, scope)
		}
		if k := fenceKey(leasehold.FenceID{Scope: scope, Partition: 7}); !validKey(k) || strings.Count(k, ".") != 3 {
			t.Errorf("fence key %q of scope %q is not a KV key of four tokens", k, scope)
		}
	}
	for _, tok := range []string{"", "a=3", "a=3a", "a=41", "a=GG", "a.b", "a:b", "=2"} {
		if s, err := parseScopeToken(tok); err == nil {
			t.Errorf("parseScopeToken(%q) = %q, want an error: scopeToken never writes it", tok, s)
		}
	}
}

// Every printable byte, in every position, survives the round trip and
// gives a key the server accepts.
func TestScopeTokenEveryByte(t *testing.T) {
	t.Parallel()
	for c := byte('!'); c < 0x7f; c++ {
		scope := "x" + string(c) + "y" + string(c)
		if err := leasehold.ValidateScope(scope); err != nil {
			t.Fatalf("scope %q: %v", scope, err)
		}
		tok := scopeToken(scope)
		if back, err := parseScopeToken(tok); err != nil || back != scope {
			t.Fatalf("scope %q: token %q reads back as %q, %v", scope, tok, back, err)
		}
		if !validKey(fenceKey(leasehold.FenceID{Scope: scope})) || strings.Contains(tok, ".") {
			t.Fatalf("scope %q: token %q is not one KV key token", scope, tok)
		}
	}
}

func TestLongestFenceKey(t *testing.T) {
	t.Parallel()
	scope := strings.Repeat(":", leasehold.MaxScopeLen)
	k := fenceKey(leasehold.FenceID{Scope: scope, Partition: leasehold.MaxPartitions - 1})
	if len(k) != MaxFenceKeyLen || !validKey(k) {
		t.Fatalf("the longest fence key is %d bytes (valid %v), MaxFenceKeyLen says %d", len(k), validKey(k), MaxFenceKeyLen)
	}
}

// Distinct (scope, key) pairs that concatenate alike get distinct dedupe
// keys, none of them a key of the layout before scopes.
func TestDedupeKey(t *testing.T) {
	t.Parallel()
	pairs := [][2]string{{"a", "b.c"}, {"a.b", "c"}, {"ab", "c"}, {"a", "bc"}, {"orders", "k1"}, {"payments", "k1"}}
	seen := map[string][2]string{}
	for _, p := range pairs {
		k := dedupeKey(p[0], p[1])
		if q, dup := seen[k]; dup {
			t.Fatalf("%v and %v share the dedupe key %s", p, q, k)
		}
		seen[k] = p
		if !validKey(k) || !strings.HasPrefix(k, dedupePrefix) || k == legacyDedupeKey(p[1]) {
			t.Fatalf("dedupe key %q of %v", k, p)
		}
		sum := sha256.Sum256(dedupeValue(p[0], p[1]))
		if k != dedupePrefix+hex.EncodeToString(sum[:]) {
			t.Fatalf("dedupe key %s is not the hash of its value %q", k, dedupeValue(p[0], p[1]))
		}
	}
}

func FuzzScopeToken(f *testing.F) {
	f.Add("billing/account:42", "billing/account=3A42")
	f.Add("a.b", "a=2Eb")
	f.Add("=", "")
	f.Fuzz(func(t *testing.T, a, b string) {
		if leasehold.ValidateScope(a) != nil || leasehold.ValidateScope(b) != nil {
			return
		}
		ta, tb := scopeToken(a), scopeToken(b)
		if (ta == tb) != (a == b) {
			t.Fatalf("scopes %q and %q have tokens %q and %q", a, b, ta, tb)
		}
		if back, err := parseScopeToken(ta); err != nil || back != a {
			t.Fatalf("token %q of %q reads back as %q, %v", ta, a, back, err)
		}
		if !validKey(fenceKey(leasehold.FenceID{Scope: a})) {
			t.Fatalf("scope %q: fence key %q is not a KV key", a, fenceKey(leasehold.FenceID{Scope: a}))
		}
		if s, err := parseScopeToken(b); err == nil && scopeToken(s) != b {
			t.Fatalf("token %q reads as %q, whose token is %q: two tokens for one scope", b, s, scopeToken(s))
		}
	})
}
