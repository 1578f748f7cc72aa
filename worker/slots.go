package worker

import "sync"

// Every partition a worker holds may always run one job: that slot is its
// own, so no partition waits behind the others. Each further job running at
// once in a partition takes a slot of the worker's pool of
// Config.MaxConcurrency. A runner asks the pool without waiting; when the
// pool is empty it queues its wake channel, and the next slot given back
// is handed to the first runner in the queue through that channel (a
// buffered channel of one, which the runner empties before it asks
// again). A runner handed a slot it no longer needs gives it back.

// pool is a worker's shared slots.
type pool struct {
	mu      sync.Mutex
	free    int
	waiters []chan struct{}
}

func newPool(n int) *pool { return &pool{free: n} }

// take takes a slot if one is free. When none is, wake is queued to be
// handed the next slot given back.
func (p *pool) take(wake chan struct{}) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.free > 0 {
		p.free--
		return true
	}
	for _, w := range p.waiters {
		if w == wake {
			return false
		}
	}
	p.waiters = append(p.waiters, wake)
	return false
}

// give returns a slot: to the first runner waiting, or to the pool.
func (p *pool) give() {
	p.mu.Lock()
	for len(p.waiters) > 0 {
		w := p.waiters[0]
		p.waiters[0] = nil
		p.waiters = p.waiters[1:]
		select {
		case w <- struct{}{}:
			p.mu.Unlock()
			return
		default:
			// It holds a slot it has not taken up yet: not waiting.
		}
	}
	p.free++
	p.mu.Unlock()
}

// leave takes wake off the queue, and gives back a slot it was handed and
// did not take up: its runner has ended.
func (p *pool) leave(wake chan struct{}) {
	p.mu.Lock()
	for i, w := range p.waiters {
		if w == wake {
			p.waiters = append(p.waiters[:i], p.waiters[i+1:]...)
			break
		}
	}
	p.mu.Unlock()
	select {
	case <-wake:
		p.give()
	default:
	}
}
