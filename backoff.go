package eventline

import (
	"cmp"
	"fmt"
	"math"
	"time"
)

// Backoff is an exponential schedule of waits, the one shape every retrying
// part of eventline is configured with (the relay's publish retries, the
// consumer's handler retries, its waits for an unavailable database or
// broker, and the release of parked events). The n-th wait (n ≥ 1) is
//
//	min(Initial × Multiplier^(n−1), Max)
//
// spread at random by up to ±Jitter of itself. A zero field takes the
// default of the configuration that holds the Backoff, which its comment
// names.
type Backoff struct {
	// Initial is the first wait.
	Initial time.Duration
	// Max caps every wait.
	Max time.Duration
	// Multiplier scales each wait from the one before; at least 1.
	Multiplier float64
	// Jitter spreads each wait at random by up to this fraction of it,
	// between 0 and 1, so processes that failed together do not retry
	// together. 0 waits exactly the schedule.
	Jitter float64
}

// Or returns b with each zero field taken from def.
func (b Backoff) Or(def Backoff) Backoff {
	b.Initial = cmp.Or(b.Initial, def.Initial)
	if b.Max == 0 {
		b.Max = max(def.Max, b.Initial)
	}
	b.Multiplier = cmp.Or(b.Multiplier, def.Multiplier)
	b.Jitter = cmp.Or(b.Jitter, def.Jitter)
	return b
}

// Validate reports a setting that cannot make a schedule, naming field
// (say "consumer.Config.Retry").
func (b Backoff) Validate(field string) error {
	switch {
	case b.Initial <= 0:
		return fmt.Errorf("%s.Initial is %s; it must be positive", field, b.Initial)
	case b.Max < b.Initial:
		return fmt.Errorf("%s.Max (%s) is below Initial (%s)", field, b.Max, b.Initial)
	case b.Multiplier < 1 || math.IsNaN(b.Multiplier) || math.IsInf(b.Multiplier, 0):
		return fmt.Errorf("%s.Multiplier is %g; it must be at least 1", field, b.Multiplier)
	case b.Jitter < 0 || b.Jitter > 1 || math.IsNaN(b.Jitter):
		return fmt.Errorf("%s.Jitter is %g; it must be between 0 and 1", field, b.Jitter)
	}
	return nil
}
