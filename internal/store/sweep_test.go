package store_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// deliver admits a versioned event of aggregate "acct"/id in its own
// transaction and parks it when it is a gap; it returns the verdict.
func deliver(t *testing.T, s *store.Store, env pgtest.Env, id string, v int64) store.Verdict {
	t.Helper()
	ctx := context.Background()
	var verdict store.Verdict
	require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		e := ev(id, v)
		a := admit(t, s, tx, e, false)
		verdict = a.Verdict
		if a.Verdict == store.Gap {
			_, err := s.Park(ctx, tx, store.ParkRequest{Group: "g", Event: e, Handler: "h", Current: a.Previous, MaxGap: versioning.DefaultMaxGap})
			return err
		}
		return nil
	}))
	return verdict
}

// applied records what a sweeper's Apply was called with.
type applied struct {
	mu    sync.Mutex
	calls []string
	fail  func(p store.Parked) error
}

func (a *applied) apply(_ context.Context, _ pgx.Tx, p store.Parked) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, p.AggregateID)
	if a.fail != nil {
		return a.fail(p)
	}
	return nil
}

func (a *applied) count(id string) (n int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, c := range a.calls {
		if c == id {
			n++
		}
	}
	return n
}

// When the sweeper gives up a gap and the parked event behind it fails to
// apply (its payload does not decode…), the skip and the version move roll
// back with it. Before: the gap was audited as skipped and the version
// moved although nothing was applied.
func TestSweeperSkipRollsBackWhenTheEventFails(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	a := &applied{fail: func(store.Parked) error { return errors.New("payload does not decode") }}
	w := s.NewSweeper(env.Pool, sweeper("g", time.Nanosecond, release(a.apply, 0)))
	require.Equal(t, store.Next, deliver(t, s, env, "a", 1))
	require.Equal(t, store.Gap, deliver(t, s, env, "a", 3))

	res, err := w.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Failed)
	require.Zero(t, res.GapsSkipped)
	cur, err := s.Current(ctx, env.Pool, store.Key{Group: "g", AggregateType: "acct", AggregateID: "a"})
	require.NoError(t, err)
	require.EqualValues(t, 1, cur, "the version did not move")
	skipped, err := s.ListSkipped(ctx, env.Pool, store.SkippedFilter{Group: "g"})
	require.NoError(t, err)
	require.Empty(t, skipped, "nothing audited as skipped")
	parked, err := s.ListParked(ctx, env.Pool, store.ParkedFilter{Group: "g"})
	require.NoError(t, err)
	require.Len(t, parked, 1)
	require.Equal(t, 1, parked[0].ReleaseAttempts)
	require.Contains(t, parked[0].LastError, "payload does not decode")
	require.True(t, parked[0].NextAttemptAt.After(parked[0].LastAttemptAt), "retried after a backoff")
}

// A parked event that can never be applied is given up after
// MaxReleaseAttempts: dead-lettered (by default held as a late event of
// kind release_failed), its version audited as skipped, and the
// aggregate's later events go on. Before: it was retried on every pass
// forever and its aggregate stayed wedged behind it.
func TestParkedEventIsGivenUpAfterMaxReleaseAttempts(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	a := &applied{fail: func(p store.Parked) error {
		if p.Version == 3 {
			return errors.New("handler bug")
		}
		return nil
	}}
	r := release(a.apply, time.Nanosecond)
	r.MaxAttempts = 3
	w := s.NewSweeper(env.Pool, sweeper("g", time.Hour, r))
	require.Equal(t, store.Next, deliver(t, s, env, "a", 1))
	require.Equal(t, store.Gap, deliver(t, s, env, "a", 3))
	require.Equal(t, store.Gap, deliver(t, s, env, "a", 4))
	require.Equal(t, store.Next, deliver(t, s, env, "a", 2))
	// v3 is ready (its predecessor v2 is applied; no drain ran here): the
	// sweeper tries it.
	for i := 1; i <= 3; i++ {
		res, err := w.Sweep(ctx)
		require.NoError(t, err)
		if i < 3 {
			require.Equal(t, 1, res.Failed, "attempt %d", i)
			continue
		}
		require.Equal(t, 1, res.DeadLettered, "given up on the third failure")
		require.Equal(t, 1, res.Released, "v4 applied after it")
		require.EqualValues(t, 1, res.VersionsSkipped)
	}
	cur, err := s.Current(ctx, env.Pool, store.Key{Group: "g", AggregateType: "acct", AggregateID: "a"})
	require.NoError(t, err)
	require.EqualValues(t, 4, cur)
	skipped, err := s.ListSkipped(ctx, env.Pool, store.SkippedFilter{Group: "g"})
	require.NoError(t, err)
	require.Len(t, skipped, 1)
	require.Equal(t, [2]int64{3, 3}, [2]int64{skipped[0].From, skipped[0].To})
	require.Contains(t, skipped[0].Reason, "after 3 failed release attempts: handler bug")
	late, err := s.Held().List(ctx, env.Pool, held.Filter{Kind: held.KindLate, Group: "g"})
	require.NoError(t, err)
	require.Len(t, late, 1)
	require.Equal(t, held.CauseReleaseFailed, late[0].Cause)
	require.EqualValues(t, 3, late[0].AggregateVersion)
	require.Equal(t, 3, late[0].Attempts, "its release attempts")
	require.Equal(t, "handler bug", late[0].LastError)
	rec, err := s.Processed(ctx, env.Pool, store.RecordKey{Group: "g", EventID: late[0].EventID, AggregateType: late[0].AggregateType, AggregateID: late[0].AggregateID})
	require.NoError(t, err)
	require.Equal(t, dedup.OutcomeLate, rec.Outcome, "a redelivery is a duplicate while it is held")

	// A permanent failure is given up at once, in the same transaction.
	r = release(a.apply, time.Nanosecond)
	r.MaxAttempts, r.Permanent = 10, func(error) bool { return true }
	w2 := s.NewSweeper(env.Pool, sweeper("g", time.Hour, r))
	require.Equal(t, store.Gap, deliver(t, s, env, "b", 2))
	_, err = s.ReleaseGap(ctx, env.Pool, "g", "acct", "b", "v1 lost")
	require.NoError(t, err)
	parked, err := s.ListParked(ctx, env.Pool, store.ParkedFilter{Group: "g", AggregateID: "b"})
	require.NoError(t, err)
	require.Len(t, parked, 1)
	a.fail = func(store.Parked) error { return errors.New("cannot decode") }
	res, err := w2.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.DeadLettered)
	late, err = s.Held().List(ctx, env.Pool, held.Filter{Kind: held.KindLate, Group: "g", AggregateID: "b"})
	require.NoError(t, err)
	require.Len(t, late, 1)
	require.Contains(t, late[0].Reason, "can never be applied: cannot decode")
	rec, err = s.Processed(ctx, env.Pool, parked[0].RecordKey())
	require.NoError(t, err)
	require.Equal(t, dedup.OutcomeLate, rec.Outcome, "held, so a redelivery is a duplicate")
}

// Aggregates whose parked events keep failing cannot starve the others:
// each failure pushes the aggregate's next attempt back, and the sweeper
// takes due aggregates first. Before: its oldest-first query returned the
// same Batch wedged aggregates on every pass and never reached the rest.
func TestWedgedAggregatesCannotStarveTheSweeper(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	a := &applied{fail: func(p store.Parked) error {
		if p.AggregateID != "healthy" {
			return errors.New("wedged")
		}
		return nil
	}}
	cfg := sweeper("g", time.Nanosecond, release(a.apply, 0))
	cfg.Batch = 2
	w := s.NewSweeper(env.Pool, cfg)
	for _, id := range []string{"wedged-1", "wedged-2", "healthy"} { // oldest first
		require.Equal(t, store.Next, deliver(t, s, env, id, 1))
		require.Equal(t, store.Gap, deliver(t, s, env, id, 3))
	}
	for pass := 0; pass < 3 && a.count("healthy") == 0; pass++ {
		_, err := w.Sweep(ctx)
		require.NoError(t, err)
	}
	require.Equal(t, 1, a.count("healthy"), "the healthy aggregate was reached")
	require.Equal(t, 1, a.count("wedged-1"), "a wedged aggregate waits for its backoff")
	require.Equal(t, 1, a.count("wedged-2"))
}

// The park timeout is the operator's window to replay a relay dead letter
// in order. The relay dead-letters after MaxAttempts publishes with the
// Backoff waits between them, 1s+5s+25s+125s = 156s by default; the
// aggregate's later events only reach consumers after that (same shard),
// so the window is the whole park timeout: an hour. Before: 15 minutes,
// documented as outlasting a 13-minute relay schedule that does not exist.
func TestDefaultParkTimeoutLeavesAnOperatorWindow(t *testing.T) {
	t.Parallel()
	var relay time.Duration
	for n := 1; n < producer.DefaultMaxAttempts; n++ {
		relay += backoff.Delay(eventline.Backoff{Initial: producer.DefaultBackoffInitial, Multiplier: producer.DefaultBackoffMultiplier, Max: producer.DefaultBackoffMax}, n)
	}
	require.Equal(t, 156*time.Second, relay, "the relay's time to dead-letter, as documented")
	require.GreaterOrEqual(t, versioning.DefaultParkTimeout, time.Hour, "an operator paged by the dead letter has an hour")
	require.Greater(t, versioning.DefaultParkTimeout, 10*relay)
}
