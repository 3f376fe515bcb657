// Package latest hands the newest value of a changing state to any number
// of subscribers without ever blocking the publisher: each subscriber's
// one-slot channel holds the latest value, replacing an undelivered older
// one, so a slow reader misses intermediate values, never the last.
package latest

import "sync"

// Value is a published state.
type Value[T any] struct {
	mu   sync.Mutex
	last T
	subs map[chan T]struct{}
}

// New starts with initial.
func New[T any](initial T) *Value[T] {
	return &Value[T]{last: initial, subs: map[chan T]struct{}{}}
}

// Publish records v and delivers it to every subscriber.
func (l *Value[T]) Publish(v T) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last = v
	for ch := range l.subs {
		// The only sender on ch holds l.mu, so after the drain the send
		// always has room.
		select {
		case <-ch:
		default:
		}
		ch <- v
	}
}

// Get returns the latest value.
func (l *Value[T]) Get() T {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.last
}

// Subscribe returns a channel that starts with the current value; cancel
// releases it.
func (l *Value[T]) Subscribe() (<-chan T, func()) {
	ch := make(chan T, 1)
	l.mu.Lock()
	l.subs[ch] = struct{}{}
	ch <- l.last
	l.mu.Unlock()
	return ch, func() {
		l.mu.Lock()
		delete(l.subs, ch)
		l.mu.Unlock()
	}
}
