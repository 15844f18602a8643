// Package startwait waits for a dependency (PostgreSQL, Kafka) that is
// unavailable when a long-running component starts (the consumer, the
// relay, `eventline relay`): one started during a restart, failover or
// broker outage starts when the dependency answers, while a configuration
// mistake still fails at once.
package startwait

import (
	"context"
	"time"
)

// Policy says how to wait.
type Policy struct {
	// First is the first wait; waits double up to Max.
	First, Max time.Duration
	// Unavailable reports whether an error means the dependency is
	// unavailable (worth waiting for) rather than misconfigured.
	Unavailable func(error) bool
	// Waiting is called before each wait, to log it.
	Waiting func(wait time.Duration, err error)
}

// Retry runs try until it returns nil, returns an error p.Unavailable does
// not accept, or ctx ends. It returns try's last error, or nil when ctx
// ended first (the caller checks ctx).
func (p Policy) Retry(ctx context.Context, try func() error) error {
	wait := p.First
	for {
		err := try()
		switch {
		case err == nil, ctx.Err() != nil:
			return nil
		case !p.Unavailable(err):
			return err
		}
		if p.Waiting != nil {
			p.Waiting(wait, err)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		wait = min(2*wait, p.Max)
	}
}
