package main

import (
	"sync"
	"time"
)

// credits is how many events a windowed stream (a read's data, a process's output) may still
// send; the host gives more as it consumes them, and n < 0 cancels the stream.
type credits struct {
	mu        sync.Mutex
	available int64
	cancelled bool
	changed   chan struct{} // closed and replaced at every give: wakes every waiter
}

func newCredits(window int64) *credits {
	return &credits{available: window, changed: make(chan struct{})}
}

// take waits for a credit and uses it; false if the host cancelled or went quiet.
func (c *credits) take() bool {
	deadline := time.NewTimer(creditTimeout)
	defer deadline.Stop()
	c.mu.Lock()
	for {
		if c.cancelled {
			c.mu.Unlock()
			return false
		}
		if c.available > 0 {
			c.available--
			c.mu.Unlock()
			return true
		}
		changed := c.changed
		c.mu.Unlock()
		select {
		case <-changed:
		case <-deadline.C:
			return false
		}
		c.mu.Lock()
	}
}

func (c *credits) give(n int64) {
	c.mu.Lock()
	if n < 0 {
		c.cancelled = true
	} else {
		c.available += n
	}
	close(c.changed)
	c.changed = make(chan struct{})
	c.mu.Unlock()
}

func (c *credits) wasCancelled() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cancelled
}
