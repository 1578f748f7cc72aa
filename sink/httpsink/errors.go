package httpsink

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/leasehold/leasehold/sink/streamsink"
)

// ErrRelaySuperseded is the cause of a relay term's end when a receiver's
// Verifier answered that a newer relay's epoch is recorded: this relay
// lost its lock (it may not know yet, if it was paused) and must deliver
// nothing more under it.
var ErrRelaySuperseded = errors.New("httpsink: a receiver recorded a newer relay epoch: this relay lost its lock")

// DeliveryError is a request that did not deliver its effect: the
// receiver's answer (its status and the start of its body) or why no
// answer came. It names the endpoint by its name and origin only, never
// its path or query, and holds no request header: those may be
// credentials.
//
// A permanent one matches streamsink.ErrPoison (the runner moves the
// effect to its dead-letter stream at once): a 4xx other than 408, 409
// and 429, a 3xx (redirects are off, led elsewhere, or a 301, 302 or 303,
// which would resend the effect as a GET without its body), an effect too
// large, or one no endpoint takes. Any other (5xx, 408, 409, 429, a
// timeout, a refused or reset connection) is retried by the runner with
// its backoff, up to streamsink.Config.MaxDeliveries tries.
type DeliveryError struct {
	Endpoint string // the endpoint's name
	Origin   string // scheme://host:port of the endpoint
	Method   string
	Status   int    // the response's status, 0 when none came
	Body     string // the start of the response's body, on one line
	Err      string // why no response came, or what was wrong with it
	// RetryAfter is what a 429 or 503 asked for, bounded by
	// Config.MaxRetryAfter.
	RetryAfter time.Duration
	Permanent  bool
}

func (e *DeliveryError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "httpsink: %s to endpoint %s (%s)", e.Method, e.Endpoint, e.Origin)
	if e.Status != 0 {
		fmt.Fprintf(&b, ": %d %s", e.Status, http.StatusText(e.Status))
	}
	if e.Err != "" {
		b.WriteString(": " + e.Err)
	}
	if e.Body != "" {
		b.WriteString(": body: " + e.Body)
	}
	if e.RetryAfter > 0 {
		fmt.Fprintf(&b, " (retry after %v)", e.RetryAfter)
	}
	if e.Permanent {
		b.WriteString(" (permanent: no retry can deliver it)")
	}
	return b.String()
}

// Is makes errors.Is(err, streamsink.ErrPoison) true for a permanent
// failure.
func (e *DeliveryError) Is(target error) bool {
	return e.Permanent && target == streamsink.ErrPoison
}

// maxExcerpt bounds the body text a DeliveryError keeps; the runner's dead
// letter keeps 512 bytes of the whole error.
const maxExcerpt = 256

// excerpt makes b fit an error: printable ASCII on one line, at most n
// bytes.
func excerpt(b []byte, n int) string {
	out := make([]byte, 0, min(len(b), n))
	for _, c := range b {
		if len(out) >= n {
			return string(out[:n-3]) + "..."
		}
		if c < 0x20 || c > 0x7e {
			c = ' '
		}
		out = append(out, c)
	}
	return strings.TrimSpace(string(out))
}

// parseRetryAfter reads a Retry-After value (RFC 9110, 10.2.3): seconds
// as a non-negative decimal, or an HTTP date. It returns 0 when the value
// is missing or malformed.
func parseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if v[0] >= '0' && v[0] <= '9' {
		if len(v) > 9 {
			return 0 // more than 31 years; the caller bounds it anyway
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return 0
		}
		return time.Duration(n) * time.Second
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0
	}
	return max(t.Sub(now), 0)
}
