package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
)

func event() eventline.Event {
	return eventline.Event{ID: eventline.NewEventID(), Type: "t", AggregateType: "a", AggregateID: "1", AggregateVersion: 1}
}

func TestInsertRecognisesDuplicatesAndRollsBackWithTheTransaction(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	e := event()

	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	fresh, err := s.RecordProcessed(ctx, tx, "g", e, dedup.OutcomeApplied)
	require.NoError(t, err)
	require.True(t, fresh)
	require.NoError(t, tx.Rollback(ctx))
	_, err = s.Processed(ctx, env.Pool, store.RecordKeyOf("g", e))
	require.ErrorIs(t, err, store.ErrNotFound, "a rolled-back handler leaves no record")

	fresh, err = s.RecordProcessed(ctx, env.Pool, "g", e, dedup.OutcomeApplied)
	require.NoError(t, err)
	require.True(t, fresh)
	fresh, err = s.RecordProcessed(ctx, env.Pool, "g", e, dedup.OutcomeApplied)
	require.NoError(t, err)
	require.False(t, fresh, "second insert is a duplicate")
	fresh, err = s.RecordProcessed(ctx, env.Pool, "other", e, dedup.OutcomeApplied)
	require.NoError(t, err)
	require.True(t, fresh, "groups are independent")

	require.NoError(t, s.SetOutcome(ctx, env.Pool, store.RecordKeyOf("g", e), dedup.OutcomeStale))
	r, err := s.Processed(ctx, env.Pool, store.RecordKeyOf("g", e))
	require.NoError(t, err)
	require.Equal(t, dedup.OutcomeStale, r.Outcome)
	require.Equal(t, e.AggregateID, r.AggregateID)
	n, err := s.CountProcessed(ctx, env.Pool, "g")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
}

// Two transactions recording the same event: the second waits for the
// first and, once it commits, sees a duplicate.
func TestConcurrentInsertOfOneEventSerializes(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	e := event()
	tx1, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	fresh, err := s.RecordProcessed(ctx, tx1, "g", e, dedup.OutcomeApplied)
	require.NoError(t, err)
	require.True(t, fresh)

	second := make(chan bool, 1)
	go func() {
		fresh, err := s.RecordProcessed(ctx, env.Pool, "g", e, dedup.OutcomeApplied)
		if err != nil {
			t.Error(err)
		}
		second <- fresh
	}()
	// The second insert blocks on the first transaction's row.
	require.Eventually(t, func() bool {
		return pgtest.Count(t, env.Pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`, env.Schema) == 1
	}, 10*time.Second, 10*time.Millisecond)
	select {
	case <-second:
		t.Fatal("the second insert must wait for the first transaction")
	default:
	}
	require.NoError(t, tx1.Commit(ctx))
	require.False(t, <-second)
}

func TestCleanupDeletesOldRowsInBoundedBatches(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	table := sqlident.Qualify(env.Schema, "processed_events")
	// 25 old applied rows in g, 2 old parked and 1 old late row in g (their
	// events are still waiting), 5 old rows in h,
	// 4 recent rows in g.
	_, err := env.Pool.Exec(ctx, `INSERT INTO `+table+` (consumer_group, event_id, outcome, processed_at)
		SELECT 'g', 'old-' || i, 'applied', now() - interval '10 days' FROM generate_series(1, 25) i
		UNION ALL SELECT 'g', 'parked-' || i, 'parked', now() - interval '10 days' FROM generate_series(1, 2) i
		UNION ALL SELECT 'g', 'late-1', 'late', now() - interval '10 days'
		UNION ALL SELECT 'h', 'other-' || i, 'stale', now() - interval '10 days' FROM generate_series(1, 5) i
		UNION ALL SELECT 'g', 'new-' || i, 'applied', now() FROM generate_series(1, 4) i`)
	require.NoError(t, err)

	res, err := s.CleanupProcessed(ctx, env.Pool, store.CleanupConfig{Group: "g", Retention: 24 * time.Hour, BatchSize: 10, Pause: time.Millisecond, MaxBatches: 2})
	require.NoError(t, err)
	require.EqualValues(t, 20, res.Deleted, "MaxBatches × BatchSize at most")
	require.Equal(t, 2, res.Batches)

	res, err = s.CleanupProcessed(ctx, env.Pool, store.CleanupConfig{Group: "g", Retention: 24 * time.Hour, BatchSize: 10, Pause: time.Millisecond})
	require.NoError(t, err)
	require.EqualValues(t, 5, res.Deleted)
	require.Equal(t, 1, res.Batches, "a short batch ends the run")
	require.Equal(t, 7, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+table+` WHERE consumer_group = 'g'`), "parked, late and recent rows stay")
	require.Equal(t, 5, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+table+` WHERE consumer_group = 'h'`), "other groups stay")

	res, err = s.CleanupProcessed(ctx, env.Pool, store.CleanupConfig{Retention: 24 * time.Hour})
	require.NoError(t, err)
	require.EqualValues(t, 5, res.Deleted, "no group: every group")
}

// Cleanup pauses between batches and stops when ctx ends.
func TestCleanupHonoursPauseAndContext(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	table := sqlident.Qualify(env.Schema, "processed_events")
	_, err := env.Pool.Exec(context.Background(), `INSERT INTO `+table+` (consumer_group, event_id, outcome, processed_at)
		SELECT 'g', 'old-' || i, 'applied', now() - interval '10 days' FROM generate_series(1, 30) i`)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	res, err := s.CleanupProcessed(ctx, env.Pool, store.CleanupConfig{Group: "g", BatchSize: 10, Pause: time.Hour})
	require.ErrorIs(t, err, context.Canceled)
	require.LessOrEqual(t, res.Batches, 1, "nothing runs after ctx ended, and never a batch without the pause before it")
}

func TestCleanupConfigErrorsNameTheField(t *testing.T) {
	t.Parallel()
	s, err := store.New("")
	require.NoError(t, err)
	require.Equal(t, "eventline", s.Schema())
	for _, tc := range []struct {
		cfg  store.CleanupConfig
		want string
	}{
		{store.CleanupConfig{Retention: time.Second}, "CleanupConfig.Retention"},
		{store.CleanupConfig{BatchSize: -1}, "CleanupConfig.BatchSize"},
		{store.CleanupConfig{Pause: -1}, "CleanupConfig.Pause"},
		{store.CleanupConfig{MaxBatches: -1}, "CleanupConfig.MaxBatches"},
	} {
		_, err := s.CleanupProcessed(context.Background(), nil, tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err = store.New("bad schema")
	require.Error(t, err)
}

// An event id is recorded per aggregate: an event of another aggregate
// that carries a recorded id is a different event, recorded on its own,
// and each is a duplicate of itself only. So a record that reuses a
// genuine event's id on another aggregate, arriving first, no longer
// costs the genuine event (before: it was refused as an id conflict).
func TestAnIDReusedByAnotherAggregateIsAnotherEvent(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	genuine := event()
	reused := genuine
	reused.AggregateID = "2"
	otherType := genuine
	otherType.AggregateType, otherType.Type = "b", "other"
	for _, e := range []eventline.Event{reused, otherType, genuine} {
		fresh, err := s.RecordProcessed(ctx, env.Pool, "g", e, dedup.OutcomeApplied)
		require.NoError(t, err, "%s/%s", e.AggregateType, e.AggregateID)
		require.True(t, fresh, "%s/%s is recorded on its own", e.AggregateType, e.AggregateID)
	}
	for _, e := range []eventline.Event{reused, otherType, genuine} {
		fresh, err := s.RecordProcessed(ctx, env.Pool, "g", e, dedup.OutcomeApplied)
		require.NoError(t, err)
		require.False(t, fresh, "%s/%s: a duplicate of itself", e.AggregateType, e.AggregateID)
	}
	n, err := s.CountProcessed(ctx, env.Pool, "g")
	require.NoError(t, err)
	require.EqualValues(t, 3, n, "a record of every event the group saw")
}

// A dedup hit on a row recorded for a different event of the same
// aggregate (another version or type under the same id) is an id
// conflict, not a duplicate. Before: Insert reported a duplicate and the
// second event was skipped.
func TestInsertTellsAnIDConflictFromADuplicate(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	e := event()
	fresh, err := s.RecordProcessed(ctx, env.Pool, "g", e, dedup.OutcomeApplied)
	require.NoError(t, err)
	require.True(t, fresh)
	fresh, err = s.RecordProcessed(ctx, env.Pool, "g", e, dedup.OutcomeApplied)
	require.NoError(t, err)
	require.False(t, fresh, "the same event: a duplicate")
	for _, change := range []func(*eventline.Event){
		func(o *eventline.Event) { o.AggregateVersion = 2 },
		func(o *eventline.Event) { o.Type = "other" },
	} {
		other := e
		change(&other)
		_, err := s.RecordProcessed(ctx, env.Pool, "g", other, dedup.OutcomeApplied)
		var c *dedup.IDConflictError
		require.ErrorAs(t, err, &c)
		require.ErrorIs(t, err, dedup.ErrIDConflict)
		require.Equal(t, e.ID, c.EventID)
		require.Equal(t, e.AggregateID, c.Recorded.AggregateID)
		require.Contains(t, err.Error(), "republish a genuine event under a new id")
	}
}

// A conflicting row recorded by a concurrent transaction is not visible to
// the statement that waited for it; Insert reads it again and still tells
// the conflict.
func TestConcurrentIDConflictIsDetected(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	e := event()
	tx1, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = s.RecordProcessed(ctx, tx1, "g", e, dedup.OutcomeApplied)
	require.NoError(t, err)
	other := e
	other.AggregateVersion = 2
	second := make(chan error, 1)
	go func() {
		_, err := s.RecordProcessed(ctx, env.Pool, "g", other, dedup.OutcomeApplied)
		second <- err
	}()
	require.Eventually(t, func() bool {
		return pgtest.Count(t, env.Pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`, env.Schema) == 1
	}, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, tx1.Commit(ctx))
	require.ErrorIs(t, <-second, dedup.ErrIDConflict)
}
