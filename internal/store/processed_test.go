package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

// processedBundle is what the dedup-record tests share: a store in its own
// schema.
type processedBundle struct {
	ctx   context.Context
	s     *store.Store
	env   pgtest.Env
	table string // processed_events, qualified
}

func setupProcessed(t *testing.T) processedBundle {
	t.Helper()
	s, env := newStore(t)
	return processedBundle{ctx: context.Background(), s: s, env: env, table: sqlident.Qualify(env.Schema, "processed_events")}
}

// record records e for group through db (outcome applied) and returns
// whether it was fresh.
func (b processedBundle) record(t *testing.T, db store.BatchDB, group string, e eventline.Event) bool {
	t.Helper()
	fresh, err := b.s.RecordProcessed(b.ctx, db, group, e, dedup.OutcomeApplied)
	require.NoError(t, err, "%s/%s", e.AggregateType, e.AggregateID)
	return fresh
}

// recordInTx records a new event for group g in a transaction it leaves
// open (rolled back when the test ends unless committed).
func (b processedBundle) recordInTx(t *testing.T) (eventline.Event, pgx.Tx) {
	t.Helper()
	e, tx := event(), begin(t, b.env)
	require.True(t, b.record(t, tx, "g", e))
	return e, tx
}

func (b processedBundle) count(t *testing.T, group string) int64 {
	t.Helper()
	return int64(pgtest.Count(t, b.env.Pool, `SELECT count(*) FROM `+b.table+` WHERE consumer_group = $1`, group))
}

// waitForOneLockWait waits until exactly one statement of the schema waits
// for a lock.
func (b processedBundle) waitForOneLockWait(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		return pgtest.Count(t, b.env.Pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`, b.env.Schema) == 1
	}, 10*time.Second, 10*time.Millisecond)
}

func TestRecordProcessed(t *testing.T) {
	t.Parallel()

	t.Run("recognises duplicates and rolls back with the transaction", func(t *testing.T) {
		t.Parallel()
		b := setupProcessed(t)
		e, tx := b.recordInTx(t)
		require.NoError(t, tx.Rollback(b.ctx))
		_, err := b.s.Processed(b.ctx, b.env.Pool, store.RecordKeyOf("g", e))
		require.ErrorIs(t, err, store.ErrNotFound, "a rolled-back handler leaves no record")

		require.True(t, b.record(t, b.env.Pool, "g", e))
		require.False(t, b.record(t, b.env.Pool, "g", e), "second insert is a duplicate")
		require.True(t, b.record(t, b.env.Pool, "other", e), "groups are independent")

		require.NoError(t, b.s.SetOutcome(b.ctx, b.env.Pool, store.RecordKeyOf("g", e), dedup.OutcomeStale))
		r, err := b.s.Processed(b.ctx, b.env.Pool, store.RecordKeyOf("g", e))
		require.NoError(t, err)
		require.Equal(t, dedup.OutcomeStale, r.Outcome)
		require.Equal(t, e.AggregateID, r.AggregateID)
		require.EqualValues(t, 1, b.count(t, "g"))
	})

	// Two transactions recording the same event: the second waits for the
	// first and, once it commits, sees a duplicate.
	t.Run("a concurrent insert of one event serializes", func(t *testing.T) {
		t.Parallel()
		b := setupProcessed(t)
		e, tx1 := b.recordInTx(t)

		second := make(chan bool, 1)
		go func() {
			fresh, err := b.s.RecordProcessed(b.ctx, b.env.Pool, "g", e, dedup.OutcomeApplied)
			if err != nil {
				t.Error(err)
			}
			second <- fresh
		}()
		// The second insert blocks on the first transaction's row.
		b.waitForOneLockWait(t)
		select {
		case <-second:
			t.Fatal("the second insert must wait for the first transaction")
		default:
		}
		require.NoError(t, tx1.Commit(b.ctx))
		require.False(t, <-second)
	})

	// An event id is recorded per aggregate: an event of another aggregate
	// that carries a recorded id is a different event, recorded on its own,
	// and each is a duplicate of itself only. So a record that reuses a
	// genuine event's id on another aggregate, arriving first, no longer
	// costs the genuine event (before: it was refused as an id conflict).
	t.Run("an id reused by another aggregate is another event", func(t *testing.T) {
		t.Parallel()
		b := setupProcessed(t)
		genuine := event()
		reused := genuine
		reused.AggregateID = "2"
		otherType := genuine
		otherType.AggregateType, otherType.Type = "b", "other"
		for _, e := range []eventline.Event{reused, otherType, genuine} {
			require.True(t, b.record(t, b.env.Pool, "g", e), "%s/%s is recorded on its own", e.AggregateType, e.AggregateID)
		}
		for _, e := range []eventline.Event{reused, otherType, genuine} {
			require.False(t, b.record(t, b.env.Pool, "g", e), "%s/%s: a duplicate of itself", e.AggregateType, e.AggregateID)
		}
		require.EqualValues(t, 3, b.count(t, "g"), "a record of every event the group saw")
	})

	// A dedup hit on a row recorded for a different event of the same
	// aggregate (another version or type under the same id) is an id
	// conflict, not a duplicate. Before: Insert reported a duplicate and the
	// second event was skipped.
	t.Run("an id conflict is told from a duplicate", func(t *testing.T) {
		t.Parallel()
		b := setupProcessed(t)
		e := event()
		require.True(t, b.record(t, b.env.Pool, "g", e))
		require.False(t, b.record(t, b.env.Pool, "g", e), "the same event: a duplicate")
		for _, change := range []func(*eventline.Event){
			func(o *eventline.Event) { o.AggregateVersion = 2 },
			func(o *eventline.Event) { o.Type = "other" },
		} {
			other := e
			change(&other)
			_, err := b.s.RecordProcessed(b.ctx, b.env.Pool, "g", other, dedup.OutcomeApplied)
			var c *dedup.IDConflictError
			require.ErrorAs(t, err, &c)
			require.ErrorIs(t, err, dedup.ErrIDConflict)
			require.Equal(t, e.ID, c.EventID)
			require.Equal(t, e.AggregateID, c.Recorded.AggregateID)
			require.Contains(t, err.Error(), "republish a genuine event under a new id")
		}
	})

	// A conflicting row recorded by a concurrent transaction is not visible
	// to the statement that waited for it; Insert reads it again and still
	// tells the conflict.
	t.Run("a concurrent id conflict is detected", func(t *testing.T) {
		t.Parallel()
		b := setupProcessed(t)
		e, tx1 := b.recordInTx(t)
		other := e
		other.AggregateVersion = 2
		second := make(chan error, 1)
		go func() {
			_, err := b.s.RecordProcessed(b.ctx, b.env.Pool, "g", other, dedup.OutcomeApplied)
			second <- err
		}()
		b.waitForOneLockWait(t)
		require.NoError(t, tx1.Commit(b.ctx))
		require.ErrorIs(t, <-second, dedup.ErrIDConflict)
	})
}

func TestCleanupProcessed(t *testing.T) {
	t.Parallel()

	t.Run("deletes old rows in bounded batches", func(t *testing.T) {
		t.Parallel()
		b := setupProcessed(t)
		// 25 old applied rows in g, 2 old parked and 1 old late row in g
		// (their events are still waiting), 5 old rows in h, 4 recent rows
		// in g.
		_, err := b.env.Pool.Exec(b.ctx, `INSERT INTO `+b.table+` (consumer_group, event_id, outcome, processed_at)
			SELECT 'g', 'old-' || i, 'applied', now() - interval '10 days' FROM generate_series(1, 25) i
			UNION ALL SELECT 'g', 'parked-' || i, 'parked', now() - interval '10 days' FROM generate_series(1, 2) i
			UNION ALL SELECT 'g', 'late-1', 'late', now() - interval '10 days'
			UNION ALL SELECT 'h', 'other-' || i, 'stale', now() - interval '10 days' FROM generate_series(1, 5) i
			UNION ALL SELECT 'g', 'new-' || i, 'applied', now() FROM generate_series(1, 4) i`)
		require.NoError(t, err)

		res, err := b.s.CleanupProcessed(b.ctx, b.env.Pool, store.CleanupConfig{Group: "g", Retention: 24 * time.Hour, BatchSize: 10, Pause: time.Millisecond, MaxBatches: 2})
		require.NoError(t, err)
		require.EqualValues(t, 20, res.Deleted, "MaxBatches × BatchSize at most")
		require.Equal(t, 2, res.Batches)

		res, err = b.s.CleanupProcessed(b.ctx, b.env.Pool, store.CleanupConfig{Group: "g", Retention: 24 * time.Hour, BatchSize: 10, Pause: time.Millisecond})
		require.NoError(t, err)
		require.EqualValues(t, 5, res.Deleted)
		require.Equal(t, 1, res.Batches, "a short batch ends the run")
		require.Equal(t, 7, pgtest.Count(t, b.env.Pool, `SELECT count(*) FROM `+b.table+` WHERE consumer_group = 'g'`), "parked, late and recent rows stay")
		require.Equal(t, 5, pgtest.Count(t, b.env.Pool, `SELECT count(*) FROM `+b.table+` WHERE consumer_group = 'h'`), "other groups stay")

		res, err = b.s.CleanupProcessed(b.ctx, b.env.Pool, store.CleanupConfig{Retention: 24 * time.Hour})
		require.NoError(t, err)
		require.EqualValues(t, 5, res.Deleted, "no group: every group")
	})

	t.Run("pauses between batches and stops when ctx ends", func(t *testing.T) {
		t.Parallel()
		b := setupProcessed(t)
		_, err := b.env.Pool.Exec(b.ctx, `INSERT INTO `+b.table+` (consumer_group, event_id, outcome, processed_at)
			SELECT 'g', 'old-' || i, 'applied', now() - interval '10 days' FROM generate_series(1, 30) i`)
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(b.ctx)
		cancel()
		res, err := b.s.CleanupProcessed(ctx, b.env.Pool, store.CleanupConfig{Group: "g", BatchSize: 10, Pause: time.Hour})
		require.ErrorIs(t, err, context.Canceled)
		require.LessOrEqual(t, res.Batches, 1, "nothing runs after ctx ended, and never a batch without the pause before it")
	})

	t.Run("config errors name the field", func(t *testing.T) {
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
	})
}
