package startwait_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/eventline/eventline/internal/startwait"
)

var (
	errDown  = errors.New("down")
	errWrong = errors.New("misconfigured")
)

func policy(waits *[]time.Duration) startwait.Policy {
	return startwait.Policy{
		First: time.Millisecond, Max: 4 * time.Millisecond,
		Unavailable: func(err error) bool { return errors.Is(err, errDown) },
		Waiting:     func(d time.Duration, _ error) { *waits = append(*waits, d) },
	}
}

func TestRetryWaitsOutAnOutageDoublingUpToMax(t *testing.T) {
	var waits []time.Duration
	tries := 0
	err := policy(&waits).Retry(context.Background(), func() error {
		if tries++; tries <= 5 {
			return errDown
		}
		return nil
	})
	if err != nil || tries != 6 {
		t.Fatalf("err %v after %d tries; want nil after 6", err, tries)
	}
	want := []time.Duration{1, 2, 4, 4, 4}
	for i := range want {
		want[i] *= time.Millisecond
	}
	if len(waits) != len(want) {
		t.Fatalf("waits %v, want %v", waits, want)
	}
	for i := range want {
		if waits[i] != want[i] {
			t.Fatalf("waits %v, want %v", waits, want)
		}
	}
}

func TestRetryReturnsAMistakeAtOnce(t *testing.T) {
	var waits []time.Duration
	err := policy(&waits).Retry(context.Background(), func() error { return errWrong })
	if !errors.Is(err, errWrong) || len(waits) != 0 {
		t.Fatalf("err %v after %d waits; want errWrong at once", err, len(waits))
	}
}

func TestRetryStopsWhenTheContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var waits []time.Duration
	err := policy(&waits).Retry(ctx, func() error {
		if len(waits) == 3 {
			cancel()
		}
		return errDown
	})
	if err != nil || ctx.Err() == nil {
		t.Fatalf("err %v, ctx %v; want nil after the cancel", err, ctx.Err())
	}
}
