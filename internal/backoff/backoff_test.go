package backoff

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
)

func TestDelayFollowsTheSchedule(t *testing.T) {
	b := eventline.Backoff{Initial: 100 * time.Millisecond, Max: time.Second, Multiplier: 2}
	var got []time.Duration
	for n := 0; n <= 6; n++ {
		got = append(got, Delay(b, n))
	}
	ms := time.Millisecond
	require.Equal(t, []time.Duration{100 * ms, 100 * ms, 200 * ms, 400 * ms, 800 * ms, time.Second, time.Second}, got)
}

// A wait is never below Initial×(1−Jitter) nor above Max×(1+Jitter), and
// never overflows, whatever the attempt number.
func TestJitteredStaysWithinTheSchedule(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		b := eventline.Backoff{
			Initial:    time.Duration(rapid.Int64Range(1, int64(time.Hour)).Draw(t, "initial")),
			Multiplier: rapid.Float64Range(1, 100).Draw(t, "multiplier"),
			Jitter:     rapid.Float64Range(0, 1).Draw(t, "jitter"),
		}
		b.Max = b.Initial + time.Duration(rapid.Int64Range(0, int64(24*time.Hour)).Draw(t, "extra"))
		n := rapid.IntRange(-5, 1<<20).Draw(t, "n")
		d := Jittered(b, n)
		lo := time.Duration(float64(b.Initial) * (1 - b.Jitter))
		hi := time.Duration(float64(b.Max) * (1 + b.Jitter))
		if d < lo-1 || d > hi+1 {
			t.Fatalf("wait %s outside [%s, %s]", d, lo, hi)
		}
	})
}

func TestRetryStopsOnAnErrorItDoesNotRetry(t *testing.T) {
	fatal := errors.New("misconfigured")
	tries := 0
	err := Retry(context.Background(), eventline.Backoff{Initial: time.Microsecond, Max: time.Microsecond, Multiplier: 1},
		func(err error) bool { return !errors.Is(err, fatal) }, nil,
		func() error {
			tries++
			if tries < 3 {
				return errors.New("unavailable")
			}
			return fatal
		})
	require.ErrorIs(t, err, fatal)
	require.Equal(t, 3, tries)
}

func TestRetryReturnsNilWhenTheContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	waits := 0
	err := Retry(ctx, eventline.Backoff{Initial: time.Hour, Max: time.Hour, Multiplier: 1},
		func(error) bool { return true },
		func(time.Duration, error) { waits++; cancel() },
		func() error { return errors.New("unavailable") })
	require.NoError(t, err)
	require.Equal(t, 1, waits)
}

// What a starting relay or consumer does while its database or Kafka is
// down: the waits follow the schedule, and the first success ends them.
func TestRetryWaitsOutAnOutageDoublingUpToMax(t *testing.T) {
	down := errors.New("down")
	var waits []time.Duration
	tries := 0
	err := Retry(context.Background(), eventline.Backoff{Initial: time.Millisecond, Max: 4 * time.Millisecond, Multiplier: 2},
		func(err error) bool { return errors.Is(err, down) },
		func(d time.Duration, _ error) { waits = append(waits, d) },
		func() error {
			if tries++; tries <= 5 {
				return down
			}
			return nil
		})
	require.NoError(t, err)
	require.Equal(t, 6, tries)
	ms := time.Millisecond
	require.Equal(t, []time.Duration{1 * ms, 2 * ms, 4 * ms, 4 * ms, 4 * ms}, waits)
}

func TestRetryReturnsAMistakeAtOnce(t *testing.T) {
	wrong := errors.New("misconfigured")
	waits := 0
	err := Retry(context.Background(), eventline.Backoff{Initial: time.Millisecond, Max: time.Millisecond, Multiplier: 1},
		func(err error) bool { return !errors.Is(err, wrong) },
		func(time.Duration, error) { waits++ },
		func() error { return wrong })
	require.ErrorIs(t, err, wrong)
	require.Zero(t, waits)
}

func TestWithSleepReplacesTheTimer(t *testing.T) {
	var waits []time.Duration
	ctx := WithSleep(context.Background(), func(_ context.Context, d time.Duration) error {
		waits = append(waits, d)
		return nil
	})
	tries := 0
	err := Retry(ctx, eventline.Backoff{Initial: time.Hour, Max: 4 * time.Hour, Multiplier: 2},
		func(error) bool { return true }, nil,
		func() error {
			if tries++; tries <= 3 {
				return errors.New("unavailable")
			}
			return nil
		})
	require.NoError(t, err)
	require.Equal(t, []time.Duration{time.Hour, 2 * time.Hour, 4 * time.Hour}, waits)
}
