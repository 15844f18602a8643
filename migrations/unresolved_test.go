package migrations_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/migrations"
)

// TestUnresolvedCountsWhatARollbackWouldDrop: parked events, late events,
// dead letters and held events still waiting are counted for the
// migration that holds them; resolved ones, other migrations and a schema
// that never had the tables count none.
func TestUnresolvedCountsWhatARollbackWouldDrop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	cfg := migrations.Config{Schema: env.Schema}
	count := func(version int) int64 {
		t.Helper()
		n, err := migrations.Unresolved(ctx, env.Pool, cfg, version)
		require.NoError(t, err)
		return n
	}
	for v := 1; v <= 3; v++ {
		require.Zero(t, count(v), "migration %d on an empty schema", v)
	}
	exec := func(sql string) {
		t.Helper()
		_, err := env.Pool.Exec(ctx, sqlident.SQL(env.Schema, sql))
		require.NoError(t, err)
	}
	exec(`INSERT INTO {schema}.parked_events (consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type, payload, metadata)
		VALUES ('billing', 'order', 'a', 5, 4, 'e5', 'order.updated', '\x7b7d', '{}'), ('billing', 'order', 'a', 6, 5, 'e6', 'order.updated', '\x7b7d', '{}')`)
	require.EqualValues(t, 2, count(2))
	require.Zero(t, count(1), "the outbox's own backlog is admin's to count")
	require.Zero(t, count(3))

	// Held events of every kind count for 003, until replayed or
	// discarded: a late event (held by the gate), dead letters, the relay's.
	vs, err := store.New(env.Schema)
	require.NoError(t, err)
	k := store.Key{Group: "billing", AggregateType: "thing", AggregateID: "a"}
	require.NoError(t, vs.RecordSkipped(ctx, env.Pool, k, 2, 2, "park timeout"))
	late, _, err := vs.HoldLate(ctx, env.Pool, store.LateRequest{Group: "billing", Event: consumertest.Event("a", 2), Current: 3, Hold: true})
	require.NoError(t, err)
	require.True(t, late)
	require.EqualValues(t, 1, count(3))
	require.EqualValues(t, 2, count(2), "parked events only")

	hs := held.New(env.Schema)
	var ids []int64
	for _, m := range []string{"m1", "m2"} {
		id, err := hs.AddDeadLetter(ctx, env.Pool, held.Event{Group: "billing", MessageUUID: m, Cause: held.CausePermanent, Reason: "r"})
		require.NoError(t, err)
		ids = append(ids, id)
	}
	require.EqualValues(t, 3, count(3))
	_, err = hs.Discard(ctx, env.Pool, held.Filter{IDs: ids[:1]}, "test")
	require.NoError(t, err)
	require.EqualValues(t, 2, count(3), "a discarded dead letter is resolved")
	require.NoError(t, hs.MarkRequested(ctx, env.Pool, ids[1]))
	require.EqualValues(t, 2, count(3), "a requested replay is not done yet")
	require.NoError(t, hs.MarkReplayed(ctx, env.Pool, ids[1]))
	require.EqualValues(t, 1, count(3), "a replayed dead letter is resolved")

	for _, uuid := range []string{"u-1", "u-2"} {
		require.NoError(t, hs.AddRelay(ctx, env.Pool, held.Event{Cause: held.CauseRejected, Reason: "r", MessageUUID: uuid}))
	}
	require.EqualValues(t, 3, count(3))
	_, err = hs.Discard(ctx, env.Pool, held.Filter{}, "test")
	require.NoError(t, err)
	require.Zero(t, count(3), "discarded held events are resolved")

	none, err := migrations.Unresolved(ctx, env.Pool, migrations.Config{Schema: pgtest.NewSchemaName(t)}, 2)
	require.NoError(t, err)
	require.Zero(t, none, "a schema without the tables holds nothing")

	_, err = migrations.Unresolved(ctx, nil, cfg, 2)
	require.ErrorContains(t, err, "migrations.Unresolved: db is nil")
	_, err = migrations.Unresolved(ctx, env.Pool, migrations.Config{Schema: `x"`}, 2)
	require.ErrorContains(t, err, "migrations.Config.Schema")
}
