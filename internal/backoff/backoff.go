// Package backoff is eventline's one implementation of exponential waits,
// for the schedule every configuration describes with eventline.Backoff.
// Callers validate the schedule at their public edge (Backoff.Validate)
// and fill its defaults (Backoff.Or); this package trusts it.
package backoff

import (
	"context"
	"math"
	"math/rand/v2"
	"time"

	"github.com/eventline/eventline"
)

// Delay is the n-th wait of b (n ≥ 1; below 1 counts as 1), before jitter:
// min(Initial × Multiplier^(n−1), Max).
func Delay(b eventline.Backoff, n int) time.Duration {
	if n < 1 {
		n = 1
	}
	w := float64(b.Initial) * math.Pow(b.Multiplier, float64(n-1))
	if math.IsNaN(w) || w >= float64(b.Max) {
		return b.Max
	}
	return time.Duration(w)
}

// Jittered is Delay spread uniformly over [d × (1−Jitter), d × (1+Jitter)].
func Jittered(b eventline.Backoff, n int) time.Duration {
	d := Delay(b, n)
	if b.Jitter == 0 || d <= 0 {
		return d
	}
	return time.Duration(float64(d) * (1 + b.Jitter*(2*rand.Float64()-1)))
}

// Sleep waits d, or until ctx ends, returning ctx's error then. When ctx
// comes from WithSleep, that function waits instead.
func Sleep(ctx context.Context, d time.Duration) error {
	if sleep, ok := ctx.Value(sleepKey{}).(func(context.Context, time.Duration) error); ok {
		return sleep(ctx, d)
	}
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Retry runs try until it returns nil, returns an error retryable does not
// accept, or ctx ends, waiting b's schedule (with jitter) between tries.
// Before each wait it calls waiting, when set, with the wait and the error.
// It returns try's last error, or nil when ctx ended first (the caller
// checks ctx).
func Retry(ctx context.Context, b eventline.Backoff, retryable func(error) bool, waiting func(time.Duration, error), try func() error) error {
	for n := 1; ; n++ {
		err := try()
		switch {
		case err == nil, ctx.Err() != nil:
			return nil
		case !retryable(err):
			return err
		}
		wait := Jittered(b, n)
		if waiting != nil {
			waiting(wait, err)
		}
		if Sleep(ctx, wait) != nil {
			return nil
		}
	}
}

type sleepKey struct{}

// WithSleep returns ctx whose waits (Sleep, and so Retry) call sleep
// instead of a timer: tests record a schedule without waiting it out.
func WithSleep(ctx context.Context, sleep func(ctx context.Context, d time.Duration) error) context.Context {
	return context.WithValue(ctx, sleepKey{}, sleep)
}
