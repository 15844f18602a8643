package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/versioning"
)

func ev(id string, v int64) eventline.Event {
	return eventline.Event{ID: eventline.NewEventID(), Type: "t", AggregateType: "acct", AggregateID: id, AggregateVersion: v, Payload: []byte(`{}`)}
}

func admit(t *testing.T, s *store.Store, db pgx.Tx, e eventline.Event, jump bool) store.Admission {
	t.Helper()
	a, err := s.Admit(context.Background(), db, "g", e, jump)
	require.NoError(t, err)
	return a
}

// begin begins a transaction on env, rolled back when the test ends
// unless committed.
func begin(t *testing.T, env pgtest.Env) pgx.Tx {
	t.Helper()
	tx, err := env.Pool.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

func TestAdmitVerdicts(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	tx := begin(t, env)

	first := ev("1", 1)
	require.Equal(t, store.Admission{Verdict: store.Next, Previous: 0, Current: 1}, admit(t, s, tx, first, false))
	require.Equal(t, store.Duplicate, admit(t, s, tx, first, false).Verdict)
	require.Equal(t, store.Stale, admit(t, s, tx, ev("1", 1), false).Verdict)
	require.Equal(t, store.Admission{Verdict: store.Gap, Previous: 1, Current: 1, Follows: 2}, admit(t, s, tx, ev("1", 3), false))
	require.Equal(t, store.Admission{Verdict: store.Jump, Previous: 1, Current: 3, Follows: 2}, admit(t, s, tx, ev("1", 3), true))
	require.Equal(t, store.Next, admit(t, s, tx, ev("1", 4), false).Verdict, "without dedup")
	// A new aggregate whose first seen version is not 1 is a gap.
	require.Equal(t, store.Admission{Verdict: store.Gap, Follows: 4}, admit(t, s, tx, ev("2", 5), false))
	require.Equal(t, store.Jump, admit(t, s, tx, ev("3", 5), true).Verdict)
	// Unless it says it follows no version (a first event numbered from
	// a version it had before it was published).
	firstAt5 := ev("4", 5)
	firstAt5.PreviousVersion = eventline.NoPreviousVersion
	require.Equal(t, store.Admission{Verdict: store.Next, Previous: 0, Current: 5, Follows: 0, Declared: true}, admit(t, s, tx, firstAt5, false))
	cur, err := s.Current(ctx, tx, store.Key{Group: "g", AggregateType: "acct", AggregateID: "1"})
	require.NoError(t, err)
	require.EqualValues(t, 4, cur)

	// The predecessor rule: an event applies once the aggregate is at the
	// version it follows, so sparse versions are no gap.
	sparse := ev("1", 10)
	sparse.PreviousVersion = 4
	require.Equal(t, store.Admission{Verdict: store.Next, Previous: 4, Current: 10, Follows: 4, Declared: true}, admit(t, s, tx, sparse, false))
	early := ev("1", 30)
	early.PreviousVersion = 20
	require.Equal(t, store.Admission{Verdict: store.Gap, Previous: 10, Current: 10, Follows: 20, Declared: true}, admit(t, s, tx, early, false))
	// Its predecessor is behind the current version: everything it
	// follows is applied, so it applies.
	behind := ev("1", 25)
	behind.PreviousVersion = 7
	require.Equal(t, store.Admission{Verdict: store.Next, Previous: 10, Current: 25, Follows: 7, Declared: true}, admit(t, s, tx, behind, false))
	stale := ev("1", 25)
	stale.PreviousVersion = 20
	require.Equal(t, store.Stale, admit(t, s, tx, stale, false).Verdict, "v <= current is stale whatever it follows")

	_, err = s.Admit(ctx, tx, "g", ev("1", 0), false)
	require.ErrorIs(t, err, eventline.ErrInvalidEvent, "the gate needs a version")
	bad := ev("1", 40)
	bad.PreviousVersion = 40
	_, err = s.Admit(ctx, tx, "g", bad, false)
	require.ErrorIs(t, err, eventline.ErrInvalidEvent, "an event cannot follow itself")
}

// Two transactions admitting the first events of a new aggregate at the
// same time: the row is created once and they serialize on it.
func TestFirstEventsOfANewAggregateSerialize(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	tx1 := begin(t, env)
	require.Equal(t, store.Next, admit(t, s, tx1, ev("new", 1), false).Verdict)

	second := make(chan store.Admission, 1)
	go func() {
		tx2, err := env.Pool.Begin(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		defer tx2.Rollback(ctx)
		a, err := s.Admit(ctx, tx2, "g", ev("new", 1), false) // same version, another event
		if err != nil {
			t.Error(err)
		}
		second <- a
	}()
	waitForLockWait(t, env)
	require.NoError(t, tx1.Commit(ctx))
	a := <-second
	require.Equal(t, store.Stale, a.Verdict, "the second sees the first's committed version, not an empty aggregate")
	require.EqualValues(t, 1, a.Previous)
}

// The sweeper skips an aggregate a live transaction holds, and ReleaseGap
// waits for it.
func TestSweeperAndReleaseSerializeOnTheAggregateLock(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	var applied []int64
	sweeper := s.NewSweeper(env.Pool, sweeper("g", time.Nanosecond, release(func(_ context.Context, _ pgx.Tx, p store.Parked) error {
		applied = append(applied, p.Version)
		return nil
	}, 0)))
	require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		admit(t, s, tx, ev("a", 1), false)
		e := ev("a", 3)
		require.Equal(t, store.Gap, admit(t, s, tx, e, false).Verdict)
		_, err := s.Park(ctx, tx, store.ParkRequest{Group: "g", Event: e, Handler: "h", MaxGap: versioning.DefaultMaxGap})
		return err
	}))

	live, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	admit(t, s, live, ev("a", 2), false) // holds the lock, not committed
	res, err := sweeper.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Busy)
	require.Empty(t, applied, "the sweeper never works on an aggregate a live consumer holds")

	released := make(chan error, 1)
	go func() {
		_, err := s.ReleaseGap(ctx, env.Pool, "g", "acct", "a", "operator")
		released <- err
	}()
	waitForLockWait(t, env)
	require.NoError(t, live.Rollback(ctx))
	require.NoError(t, <-released)

	res, err = sweeper.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Released)
	require.Equal(t, []int64{3}, applied)
	skipped, err := s.ListSkipped(ctx, env.Pool, store.SkippedFilter{Group: "g"})
	require.NoError(t, err)
	require.Len(t, skipped, 1)
	require.Equal(t, [2]int64{2, 2}, [2]int64{skipped[0].From, skipped[0].To})
}

func waitForLockWait(t *testing.T, env pgtest.Env) {
	t.Helper()
	require.Eventually(t, func() bool {
		return pgtest.Count(t, env.Pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`, env.Schema) >= 1
	}, 10*time.Second, 10*time.Millisecond)
}

func TestNewRefusesABadSchema(t *testing.T) {
	t.Parallel()
	_, err := store.New("")
	require.NoError(t, err)
	_, err = store.New("a.b")
	require.Error(t, err)
}
