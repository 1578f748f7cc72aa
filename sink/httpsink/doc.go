// Package httpsink delivers fenced effects to HTTP receivers: a relay
// behind the stream sink runner, and a Verifier for receivers you own.
//
// Delivery is at least once, with the same Idempotency-Key every time: it
// is exactly once at a receiver that honours the key (the Verifier does;
// so do Stripe-style APIs), and at least once at one that does not.
//
// # The relay
//
// A Relay is a stream sink runner's destination (streamsink.Config.Handler
// or BatchHandler: Deliver, DeliverBatch). The runner decides every
// effect against its fence before handing it over, so a stale effect (a
// zombie worker's, behind its successor's barrier) never becomes a
// request. Each admitted effect becomes one request to an endpoint from
// configuration (Config.URL, or a named endpoint picked by a route on the
// effect's subject or by a header naming it): the effect's data is the
// body; the request carries the effect's stamp (leasehold.HeaderScope and
// the others), Idempotency-Key (IdempotencyKey: the stamp's scope and key,
// as a Structured Field String), the relay's own stamp
// (HeaderRelayScope, HeaderRelayEpoch, HeaderRelayAcquisition) and W3C
// trace context. Nothing an effect carries is ever used as an address,
// and no header of the effect's is copied.
//
// The relay delivers only while it holds its lock (Config.Lock, a
// coordinator lock in the lease bucket): Run campaigns and holds it, and
// RunSink runs the runner only while it does, so two relays never both
// consume the log. A relay that was paused past its lock's TTL can still
// have a request on the wire when it wakes: its relay epoch is below its
// successor's, and a receiver that checks (the Verifier) refuses it with
// 409. A relay that gets that answer stops delivering at once and
// campaigns again (ErrRelaySuperseded).
//
// All or none, over HTTP: a job's effects reach the relay in one
// BatchHandler call once the runner holds every one of them, and its
// requests are sent together; an attempt the runner drops (aborted,
// superseded) sends none. A receiver sees separate requests, so it may see
// some of a job's before the others, and a request the receiver refuses
// for good goes to the dead-letter stream while the others were
// delivered: all are delivered at least once, or none if the job is
// dropped, with its dead letters to replay (`leasehold dlq replay`).
//
// Failures are classified (see DeliveryError): 2xx delivers; a 5xx, a
// timeout, a refused or reset connection, 408, 409 and 429 are retried
// with the runner's backoff for at most streamsink.Config.MaxDeliveries
// tries, a 429 (and a 503 or 409 that says so) waiting what its
// Retry-After asks, up to Config.MaxRetryAfter; then the effect goes to
// the runner's dead-letter stream with the status and the start of the
// body. Another 4xx, a 3xx and an effect no endpoint takes or too large
// for Config.MaxBodyBytes are permanent (streamsink.ErrPoison):
// dead-lettered at once. With Config.MaxRedirects, a 307 or 308 to the
// endpoint's own origin is followed with the same method and body; a 301,
// 302 or 303, which would resend the effect as a GET without its body, is
// never followed and is permanent. A 409 whose body is a Verifier's
// refusal of the relay's epoch stops the relay (see above); any other 409
// (the key's first request still in progress, as the Idempotency-Key
// draft answers it) is retried. A receiver that refuses the relay's epoch
// three terms in a row, while other endpoints take requests, records
// epochs the lease bucket never issued: that endpoint is fenced out, and
// its effects go to the dead-letter stream, until it takes a request
// again. A receiver that fails every request, or is fenced out, fails
// Ready, which says since when and why, until it answers again; nothing is
// lost meanwhile, since the runner moves on only once an effect is
// delivered or dead-lettered.
//
// Errors and logs name an endpoint by its name and origin (scheme, host,
// port), never its path or query, and never show Config.Header's values:
// those may be credentials.
//
// # The Verifier
//
// Verifier is net/http middleware for a receiver you own. It refuses a
// request below the highest epoch it recorded for the request's fence (a
// relayed request's relay fence; a direct request's scope and partition),
// recording and checking in one atomic step of its store, with 409 and a
// Refusal saying what superseded it; and it runs the handler once per
// Idempotency-Key, answering repeats with the first answer's status. Its
// stores: fences in any leasehold sink's fence store (sink.NewMemory,
// kvsink, pgsink), keys in MemoryKeys, KVKeys or PostgresKeys.
package httpsink
