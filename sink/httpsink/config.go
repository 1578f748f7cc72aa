package httpsink

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold"
	"github.com/leasehold/leasehold/coordinator"
	"github.com/leasehold/leasehold/telemetry"
)

// DefaultEndpoint is the name of the endpoint Config.URL configures.
const DefaultEndpoint = "default"

// Config configures a Relay. Where requests go comes from here and from
// nothing an effect carries: an effect can pick among the named endpoints
// (Routes, RouteHeader), never name a host.
type Config struct {
	// URL is the endpoint effects go to when no route picks another:
	// http or https, with a host. Optional when Endpoints and Routes cover
	// every effect.
	URL string
	// Endpoints are further endpoints by name (letters, digits, '-' and
	// '_'), for Routes and RouteHeader to pick.
	Endpoints map[string]string
	// Routes pick an endpoint by the effect's subject in the effect log:
	// the first route whose Subject (a NATS subject pattern: '*' matches
	// one token, '>' the rest) matches. An effect that no route matches
	// goes to URL.
	Routes []Route
	// RouteHeader, when set, names an effect header whose value names the
	// endpoint, before Routes are looked at. A value that names no
	// configured endpoint (a URL, say) is never used: the effect goes to
	// the dead-letter stream at once.
	RouteHeader string
	// Method of every request. Default POST.
	Method string
	// ContentType of every request's body (the effect's data). Default
	// "application/octet-stream".
	ContentType string
	// Header is sent with every request (credentials, say). Its values
	// are never logged, nor put in errors or dead letters. It may not set
	// leasehold's headers, Idempotency-Key, trace context, Host or
	// Content-* headers.
	Header http.Header

	// Timeout bounds one request, from sending it to reading the status
	// and the start of the body. Default 10s.
	Timeout time.Duration
	// MaxBodyBytes bounds a request's body: an effect whose data is larger
	// goes to the dead-letter stream at once. Default 1 MiB.
	MaxBodyBytes int
	// MaxResponseHeaderBytes bounds a response's headers. Default 64 KiB.
	MaxResponseHeaderBytes int
	// MaxRedirects is how many redirects a request follows: 307 and 308
	// only, which keep the method and the body, and only to the same
	// scheme, host and port. A 301, 302 or 303 would turn the request into
	// a GET without the effect's body, so it is never followed: it is a
	// permanent answer, and the effect goes to the dead-letter stream with
	// it. Default 0: every redirect is an answer like any 3xx, and the
	// effect goes to the dead-letter stream.
	MaxRedirects int
	// MaxRetryAfter bounds the wait a 429's Retry-After asks for. Default
	// 60s.
	MaxRetryAfter time.Duration
	// Concurrency is how many requests of one BatchHandler call are in
	// flight at once. Requests of one fence and subject go one after
	// another, in log order; others side by side. Default 8.
	Concurrency int
	// TLS configures https endpoints.
	TLS TLSConfig
	// Transport sends the requests. Default: an http.Transport built from
	// TLS, MaxResponseHeaderBytes and the proxy environment variables.
	// Timeout, MaxRedirects and the rest still apply.
	Transport http.RoundTripper

	// Coordinator takes the relay's lock in its lease bucket. Required.
	Coordinator *coordinator.Coordinator
	// Lock names the relay's lock: relays that may deliver the same
	// effects take the same one, and only its holder delivers. Default
	// "http-relay-" + Name.
	Lock string
	// LockOptions are passed to every Coordinator.Lock call.
	LockOptions []coordinator.AcquireOption

	// Name names the relay in logs, metrics and errors. Default "http".
	Name string
	// Logger receives state changes: the lock taken and lost, a receiver
	// failing and back. Default slog.Default().
	Logger *slog.Logger
	// OnEndpoint, when set, hears of the endpoints' health: each request
	// that fails while a receiver is down (no response, or a 5xx, or a
	// refusal of every relay epoch that fenced the endpoint out), and the
	// first answer after (for a fenced-out endpoint, the first request it
	// takes). It runs on the delivering goroutine and must
	// not block (statuspage.Publisher.EndpointObserver queues).
	OnEndpoint func(EndpointHealth)
	// Telemetry selects the providers of the request spans (a client span
	// per request, under the span of the effect's decision or the
	// worker's) and metrics. Zero fields mean the OpenTelemetry globals.
	Telemetry telemetry.Config
}

// Route picks an endpoint for the effects whose subject matches.
type Route struct {
	Subject  string // a NATS subject pattern
	Endpoint string // a name in Config.Endpoints, or DefaultEndpoint
}

// TLSConfig configures https endpoints.
type TLSConfig struct {
	// CAFile holds PEM certificates the receivers' are verified against,
	// instead of the system's.
	CAFile string
	// CertFile and KeyFile hold the client certificate, for receivers that
	// ask for one. Both or neither.
	CertFile, KeyFile string
	// MinVersion is the lowest TLS version accepted: tls.VersionTLS12
	// (the default) or tls.VersionTLS13.
	MinVersion uint16
}

func (c *Config) setDefaults() {
	if c.Method == "" {
		c.Method = http.MethodPost
	}
	if c.ContentType == "" {
		c.ContentType = "application/octet-stream"
	}
	if c.Timeout == 0 {
		c.Timeout = 10 * time.Second
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = 1 << 20
	}
	if c.MaxResponseHeaderBytes == 0 {
		c.MaxResponseHeaderBytes = 64 << 10
	}
	if c.MaxRetryAfter == 0 {
		c.MaxRetryAfter = time.Minute
	}
	if c.Concurrency == 0 {
		c.Concurrency = 8
	}
	if c.TLS.MinVersion == 0 {
		c.TLS.MinVersion = tls.VersionTLS12
	}
	if c.Name == "" {
		c.Name = "http"
	}
	if c.Lock == "" {
		c.Lock = "http-relay-" + c.Name
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports every problem with c.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	if c.Coordinator == nil {
		errs = append(errs, errors.New("a Coordinator is required: the relay's lock lives in its lease bucket"))
	}
	if _, err := c.endpoints(); err != nil {
		errs = append(errs, err)
	}
	if !validToken(c.Method, 32) || strings.ToUpper(c.Method) != c.Method {
		errs = append(errs, fmt.Errorf("method %q: use an upper-case HTTP method such as POST or PUT", c.Method))
	}
	if !printable(c.ContentType, 256) {
		errs = append(errs, fmt.Errorf("content type %q: use printable ASCII", c.ContentType))
	}
	if c.RouteHeader != "" && !validToken(c.RouteHeader, 128) {
		errs = append(errs, fmt.Errorf("route header %q: use a header name", c.RouteHeader))
	}
	for name, vs := range c.Header {
		if !validToken(name, 128) {
			errs = append(errs, fmt.Errorf("header %q: not a header name", name))
			continue
		}
		if reservedHeader(name) {
			errs = append(errs, fmt.Errorf("header %s: the relay sets it itself", name))
		}
		for _, v := range vs {
			if strings.ContainsAny(v, "\r\n\x00") || len(v) > 8192 {
				errs = append(errs, fmt.Errorf("header %s: a value holds a line break or a NUL, or is longer than 8192 bytes", name))
			}
		}
	}
	if c.Timeout < 0 || c.MaxRetryAfter < 0 {
		errs = append(errs, errors.New("timeout and max retry-after must not be negative"))
	}
	if c.MaxBodyBytes < 1 || c.MaxBodyBytes > 64<<20 {
		errs = append(errs, fmt.Errorf("max body bytes %d: use 1 to 64 MiB", c.MaxBodyBytes))
	}
	if c.MaxResponseHeaderBytes < 1024 || c.MaxResponseHeaderBytes > 16<<20 {
		errs = append(errs, fmt.Errorf("max response header bytes %d: use 1 KiB to 16 MiB", c.MaxResponseHeaderBytes))
	}
	if c.MaxRedirects < 0 || c.MaxRedirects > 10 {
		errs = append(errs, fmt.Errorf("max redirects %d: use 0 to 10", c.MaxRedirects))
	}
	if c.Concurrency < 1 || c.Concurrency > 1024 {
		errs = append(errs, fmt.Errorf("concurrency %d: use 1 to 1024", c.Concurrency))
	}
	if (c.TLS.CertFile == "") != (c.TLS.KeyFile == "") {
		errs = append(errs, errors.New("TLS CertFile and KeyFile go together: give both or neither"))
	}
	if c.TLS.MinVersion != tls.VersionTLS12 && c.TLS.MinVersion != tls.VersionTLS13 {
		errs = append(errs, fmt.Errorf("TLS min version %#x: use tls.VersionTLS12 or tls.VersionTLS13", c.TLS.MinVersion))
	}
	if err := leasehold.ValidateLockName(c.Lock); err != nil {
		errs = append(errs, fmt.Errorf("lock %q: %w", c.Lock, err))
	}
	if !printable(c.Name, 128) {
		errs = append(errs, fmt.Errorf("name %q: use printable ASCII, at most 128 bytes", c.Name))
	}
	return errors.Join(errs...)
}

// reservedHeader reports whether the relay writes header name itself.
func reservedHeader(name string) bool {
	n := strings.ToLower(name)
	if strings.HasPrefix(n, "leasehold-") || strings.HasPrefix(n, "content-") {
		return true
	}
	return slices.Contains([]string{"idempotency-key", "traceparent", "tracestate", "baggage", "host", "transfer-encoding", "connection", "te", "upgrade"}, n)
}

// validToken reports whether s is an HTTP token (RFC 9110) of 1 to max
// bytes: a method or a header name.
func validToken(s string, max int) bool {
	if s == "" || len(s) > max {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// endpoint is one configured destination.
type endpoint struct {
	name   string
	url    *url.URL
	origin string // scheme://host[:port], what logs and errors show: a path or query may hold a secret
	health health
}

// endpoints parses the configured endpoints and checks the routes against
// them.
func (c Config) endpoints() (map[string]*endpoint, error) {
	eps := map[string]*endpoint{}
	var errs []error
	add := func(name, raw string) {
		if !validName(name) {
			errs = append(errs, fmt.Errorf("endpoint name %q: use letters, digits, '-' and '_', at most 64", name))
			return
		}
		u, err := parseEndpoint(raw)
		if err != nil {
			errs = append(errs, fmt.Errorf("endpoint %s: %w", name, err))
			return
		}
		eps[name] = &endpoint{name: name, url: u, origin: u.Scheme + "://" + u.Host}
	}
	if c.URL != "" {
		add(DefaultEndpoint, c.URL)
	}
	for name, raw := range c.Endpoints {
		if name == DefaultEndpoint && c.URL != "" {
			errs = append(errs, fmt.Errorf("endpoint %q is the one URL sets: name the others differently", DefaultEndpoint))
			continue
		}
		add(name, raw)
	}
	if len(eps) == 0 && len(errs) == 0 {
		errs = append(errs, errors.New("no endpoint: set URL (or Endpoints)"))
	}
	for i, r := range c.Routes {
		if err := validPattern(r.Subject); err != nil {
			errs = append(errs, fmt.Errorf("route %d: subject %q: %w", i+1, r.Subject, err))
		}
		if _, ok := eps[r.Endpoint]; !ok {
			errs = append(errs, fmt.Errorf("route %d: endpoint %q is not configured", i+1, r.Endpoint))
		}
	}
	if len(c.Routes) == 0 && c.RouteHeader == "" && c.URL == "" && len(eps) > 0 {
		errs = append(errs, errors.New("named endpoints need Routes or RouteHeader to pick them, or URL for the rest"))
	}
	return eps, errors.Join(errs...)
}

func validName(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// parseEndpoint checks an endpoint URL: absolute, http or https, a host,
// no fragment.
func parseEndpoint(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("not a URL: %w", errors.Unwrap(err))
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("scheme %q: use http or https", u.Scheme)
	case u.Host == "" || u.Hostname() == "":
		return nil, errors.New("no host")
	case u.Fragment != "":
		return nil, errors.New("a fragment is never sent: remove it")
	case u.Opaque != "":
		return nil, errors.New("an opaque URL: use scheme://host/path")
	}
	if p := u.Port(); p != "" {
		if _, err := net.LookupPort("tcp", p); err != nil {
			return nil, fmt.Errorf("port %q: %w", p, err)
		}
	}
	return u, nil
}

// validPattern checks a NATS subject pattern.
func validPattern(p string) error {
	if p == "" {
		return errors.New("empty")
	}
	toks := strings.Split(p, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return errors.New("an empty token")
		case t == ">" && i != len(toks)-1:
			return errors.New("'>' must be the last token")
		case strings.ContainsAny(t, " \t\r\n") || (len(t) > 1 && strings.ContainsAny(t, "*>")):
			return fmt.Errorf("token %q: wildcards stand alone, and no spaces", t)
		}
	}
	return nil
}

// matchSubject reports whether subject matches pattern p.
func matchSubject(p, subject string) bool {
	pt, st := strings.Split(p, "."), strings.Split(subject, ".")
	for i, t := range pt {
		if t == ">" {
			return len(st) > i
		}
		if i >= len(st) || (t != "*" && t != st[i]) {
			return false
		}
	}
	return len(pt) == len(st)
}

// transport builds the default transport from c.
func (c Config) transport() (*http.Transport, error) {
	tc := &tls.Config{MinVersion: c.TLS.MinVersion}
	if c.TLS.CAFile != "" {
		pem, err := os.ReadFile(c.TLS.CAFile)
		if err != nil {
			return nil, fmt.Errorf("httpsink: TLS CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("httpsink: TLS CA file %s holds no PEM certificate", c.TLS.CAFile)
		}
		tc.RootCAs = pool
	}
	if c.TLS.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(c.TLS.CertFile, c.TLS.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("httpsink: TLS client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return &http.Transport{
		Proxy:                  http.ProxyFromEnvironment,
		DialContext:            (&net.Dialer{Timeout: min(c.Timeout, 10*time.Second), KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:        tc,
		TLSHandshakeTimeout:    min(c.Timeout, 10*time.Second),
		ForceAttemptHTTP2:      true,
		MaxIdleConns:           4 * c.Concurrency,
		MaxIdleConnsPerHost:    c.Concurrency,
		MaxConnsPerHost:        0,
		IdleConnTimeout:        90 * time.Second,
		ResponseHeaderTimeout:  c.Timeout,
		MaxResponseHeaderBytes: int64(c.MaxResponseHeaderBytes),
		ExpectContinueTimeout:  time.Second,
	}, nil
}

// client builds the relay's client: c's transport, its timeout, and its
// redirect rule.
func (c Config) client() (*http.Client, error) {
	rt := c.Transport
	if rt == nil {
		t, err := c.transport()
		if err != nil {
			return nil, err
		}
		rt = t
	}
	max := c.MaxRedirects
	return &http.Client{
		Transport: rt,
		Timeout:   c.Timeout,
		CheckRedirect: func(req *http.Request, via []*http.Request) error {
			if max == 0 {
				return http.ErrUseLastResponse
			}
			if len(via) > max {
				return fmt.Errorf("%w: more than %d redirects", errRedirect, max)
			}
			if !keepsRequest(req, via[0]) {
				// A 301, 302 or 303 has the client send a GET without
				// the effect's body: a 2xx to that would count as
				// delivered though the body never arrived. The
				// redirect is the answer, and a permanent one.
				return http.ErrUseLastResponse
			}
			first := via[0].URL
			if req.URL.Scheme != first.Scheme || req.URL.Host != first.Host {
				// Never to another origin: an endpoint that redirects
				// would choose the host, and credentials would follow.
				return fmt.Errorf("%w: to another scheme, host or port (%s://%s)", errRedirect, req.URL.Scheme, req.URL.Host)
			}
			return nil
		},
	}, nil
}

var errRedirect = errors.New("redirect refused")

// keepsRequest reports whether the redirected request req sends what the
// first request, first, sent: a 307 or 308 keeps the method and the
// body; a 301, 302 or 303 turns it into a GET without one.
func keepsRequest(req, first *http.Request) bool {
	if req.Response == nil {
		return false
	}
	switch req.Response.StatusCode {
	case http.StatusTemporaryRedirect, http.StatusPermanentRedirect:
	default:
		return false
	}
	return req.Method == first.Method && req.ContentLength == first.ContentLength &&
		(first.ContentLength == 0 || req.GetBody != nil)
}

// redirectDrops reports whether a redirect with status code would change
// the request's method or drop its body.
func redirectDrops(code int) bool {
	return code == http.StatusMovedPermanently || code == http.StatusFound || code == http.StatusSeeOther
}
