package deadletter

import (
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
)

// Header returns h's first value of name, matched without case.
func Header(h nats.Header, name string) string {
	if vs := h[name]; len(vs) > 0 {
		return vs[0]
	}
	for k, vs := range h {
		if strings.EqualFold(k, name) && len(vs) > 0 {
			return vs[0]
		}
	}
	return ""
}

// SinkHeader returns the sink header name, or else the first (by name)
// Leasehold-Sink-* header ending in one of suffixes, so that the dead
// letters of another release read too.
func SinkHeader(h nats.Header, name string, suffixes ...string) string {
	if v := Header(h, name); v != "" {
		return v
	}
	var names []string
	for k, vs := range h {
		if len(vs) > 0 && hasPrefixFold(k, sinkHeaderPrefix) {
			names = append(names, k)
		}
	}
	slices.Sort(names)
	for _, k := range names {
		for _, s := range suffixes {
			if len(k) >= len(s) && strings.EqualFold(k[len(k)-len(s):], s) {
				return h[k][0]
			}
		}
	}
	return ""
}

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}

// Clean returns s as is when it is printable text, and quoted with Go
// escapes otherwise, so that a header cannot move the cursor, fake a line
// or colour the terminal.
func Clean(s string) string {
	if !utf8.ValidString(s) {
		return strconv.Quote(s)
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return strconv.Quote(s)
		}
	}
	return s
}
