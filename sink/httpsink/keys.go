package httpsink

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"sync"
	"time"
)

// Keys is where a Verifier remembers the idempotency keys it passed: for
// each, the fingerprint of the first request's method and body, and the
// status its handler answered, or that it is being handled now. Claim is
// one atomic step: of concurrent requests with one key, one claims it and
// the others see its claim. NewMemoryKeys, NewKVKeys and NewPostgresKeys
// are the stores.
type Keys interface {
	// Claim claims key for a request whose method and body hash to sum,
	// for at most hold, unless key is known and not expired: then it
	// returns what is recorded of it (Won false).
	Claim(ctx context.Context, key string, sum [32]byte, hold time.Duration) (Claim, error)
	// Done records the status c's request was answered with, kept for
	// keep. It fails (and records nothing) when c no longer holds its
	// claim: it expired and another request claimed the key.
	Done(ctx context.Context, c Claim, status int, keep time.Duration) error
	// Release gives c's claim up: a later request with its key runs the
	// handler again.
	Release(ctx context.Context, c Claim) error
}

// Claim is what Keys.Claim found or took.
type Claim struct {
	Key string
	// Won says this request holds the claim and runs the handler.
	Won bool
	// Sum is the fingerprint of the request that claimed the key first.
	Sum [32]byte
	// Status is the first request's answer; 0 while it is in progress.
	Status int
	// Token tells this claim from a later one of the same key, for Done
	// and Release.
	Token string
}

// ErrClaimLost is matched by the error of Done and Release for a claim
// that expired and was taken by another request.
var ErrClaimLost = errors.New("httpsink: the idempotency key's claim expired and was taken by another request")

// ErrKeysFull is matched by MemoryKeys.Claim's error when it holds
// MaxKeys live keys.
var ErrKeysFull = errors.New("httpsink: the key store is full")

func newToken() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// MemoryKeys keeps keys in memory, behind one mutex: for tests and for a
// receiver of one process that may forget its keys when it restarts.
type MemoryKeys struct {
	max int

	mu   sync.Mutex
	keys map[string]*memKey
}

type memKey struct {
	sum     [32]byte
	status  int
	token   string
	expires time.Time
}

// NewMemoryKeys returns an empty store of at most max live keys (default
// 1<<20 when max is 0).
func NewMemoryKeys(max int) *MemoryKeys {
	if max <= 0 {
		max = 1 << 20
	}
	return &MemoryKeys{max: max, keys: map[string]*memKey{}}
}

// Claim implements Keys.
func (m *MemoryKeys) Claim(ctx context.Context, key string, sum [32]byte, hold time.Duration) (Claim, error) {
	if err := ctx.Err(); err != nil {
		return Claim{}, err
	}
	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	if k, ok := m.keys[key]; ok && now.Before(k.expires) {
		return Claim{Key: key, Sum: k.sum, Status: k.status, Token: k.token}, nil
	}
	if len(m.keys) >= m.max {
		for k, v := range m.keys {
			if !now.Before(v.expires) {
				delete(m.keys, k)
			}
		}
		if len(m.keys) >= m.max {
			return Claim{}, ErrKeysFull
		}
	}
	k := &memKey{sum: sum, token: newToken(), expires: now.Add(hold)}
	m.keys[key] = k
	return Claim{Key: key, Won: true, Sum: sum, Token: k.token}, nil
}

// Done implements Keys.
func (m *MemoryKeys) Done(ctx context.Context, c Claim, status int, keep time.Duration) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	k, ok := m.keys[c.Key]
	if !ok || k.token != c.Token || k.status != 0 {
		return ErrClaimLost
	}
	k.status, k.expires = status, time.Now().Add(keep)
	return nil
}

// Release implements Keys.
func (m *MemoryKeys) Release(ctx context.Context, c Claim) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if k, ok := m.keys[c.Key]; ok && k.token == c.Token && k.status == 0 {
		delete(m.keys, c.Key)
		return nil
	}
	return ErrClaimLost
}

// Len returns how many keys the store holds, expired ones included.
func (m *MemoryKeys) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.keys)
}
