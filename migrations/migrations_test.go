package migrations_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/migrations"
)

// newSchema returns a pool of conns connections and the name of a schema
// that does not exist yet, dropped when the test ends.
func newSchema(t *testing.T, conns int32) (*pgxpool.Pool, string) {
	t.Helper()
	schema := pgtest.NewSchemaName(t)
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	return pgtest.Pool(t, conns), schema
}

func TestUpDownStatusRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := newSchema(t, 4)
	cfg := migrations.Config{Schema: schema, Shards: 3}

	// Status only reads: on a schema that does not exist it reports every
	// migration pending and creates nothing.
	st, err := migrations.Status(ctx, pool, cfg)
	require.NoError(t, err)
	require.NotEmpty(t, st)
	for _, s := range st {
		require.False(t, s.Applied())
	}
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, schema))

	// Concurrent Ups are serialized by the advisory lock.
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = migrations.Up(ctx, pool, cfg) }()
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	st, err = migrations.Status(ctx, pool, cfg)
	require.NoError(t, err)
	for _, s := range st {
		require.True(t, s.Applied(), "%03d_%s", s.Version, s.Name)
	}
	tables := `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename ~ '^outbox_[0-9]+'`
	require.Equal(t, 6, pgtest.Count(t, pool, tables, schema), "3 shards, each a messages and an offsets table")

	// The shard count is fixed once created.
	err = migrations.Up(ctx, pool, migrations.Config{Schema: schema, Shards: 5})
	require.ErrorIs(t, err, migrations.ErrShardCountMismatch)
	require.NoError(t, migrations.Up(ctx, pool, migrations.Config{Schema: schema}))

	// A negative count is refused (it used to mean "all", dropping the
	// outbox on a sign slip); one step down, then all the way, then up
	// again.
	require.ErrorContains(t, migrations.Down(ctx, pool, cfg, -1), "steps is -1")
	require.Equal(t, 6, pgtest.Count(t, pool, tables, schema), "nothing rolled back")
	require.NoError(t, migrations.Down(ctx, pool, cfg, 1))
	st, err = migrations.Status(ctx, pool, cfg)
	require.NoError(t, err)
	require.True(t, st[0].Applied())
	require.False(t, st[len(st)-1].Applied())
	require.NoError(t, migrations.Down(ctx, pool, cfg, 0))
	require.Zero(t, pgtest.Count(t, pool, tables, schema), "shard tables go with the first migration")
	require.NoError(t, migrations.Up(ctx, pool, cfg))
}

func TestConfigIsValidated(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 1)
	err := migrations.Up(context.Background(), pool, migrations.Config{Schema: `x"; DROP SCHEMA public; --`})
	require.ErrorContains(t, err, "migrations.Config.Schema")
	err = migrations.Up(context.Background(), pool, migrations.Config{Schema: "ok", Shards: 5000})
	require.ErrorContains(t, err, "migrations.Config.Shards")
}

func TestEveryMigrationHasUpAndDown(t *testing.T) {
	all, err := migrations.All()
	require.NoError(t, err)
	for i, m := range all {
		require.Equal(t, i+1, m.Version, "migrations are numbered 1, 2, 3… without gaps")
		require.NotEmpty(t, m.Up)
		require.NotEmpty(t, m.Down)
	}
}

// TestBadInputIsRefusedNamingTheArgument: a nil handle (untyped or a nil
// *pgxpool.Pool) is an error naming the call, not a panic, and a schema
// name PostgreSQL reserves is refused up front, naming the field, instead
// of failing inside the migration's transaction.
func TestBadInputIsRefusedNamingTheArgument(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var nilPool *pgxpool.Pool
	for name, db := range map[string]migrations.Beginner{"untyped nil": nil, "nil pool": nilPool} {
		require.ErrorContains(t, migrations.Up(ctx, db, migrations.Config{}), "migrations.Up: db is nil", name)
		require.ErrorContains(t, migrations.Down(ctx, db, migrations.Config{}, 1), "migrations.Down: db is nil", name)
		_, err := migrations.Status(ctx, db, migrations.Config{})
		require.ErrorContains(t, err, "migrations.Status: db is nil", name)
	}

	pool := pgtest.Pool(t, 1)
	for _, schema := range []string{"pg_eventline", `x"; DROP SCHEMA public; --`, "x; drop table y", strings.Repeat("s", 64), " ", "1x"} {
		require.ErrorContains(t, migrations.Up(ctx, pool, migrations.Config{Schema: schema}), "migrations.Config.Schema", schema)
		require.ErrorContains(t, migrations.Down(ctx, pool, migrations.Config{Schema: schema}, 1), "migrations.Config.Schema", schema)
		_, err := migrations.Status(ctx, pool, migrations.Config{Schema: schema})
		require.ErrorContains(t, err, "migrations.Config.Schema", schema)
	}
}

// A schema migrated by a pre-release eventline (migrations 003_consumer_gate
// to 007_dedup_scope, squashed for the first release) is refused by Up and
// Down, naming what it records and how to move it, and nothing changes.
func TestAPreReleaseSchemaIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := newSchema(t, 2)
	cfg := migrations.Config{Schema: schema, Shards: 1}
	require.NoError(t, migrations.Up(ctx, pool, cfg))
	require.NoError(t, migrations.Down(ctx, pool, cfg, 1))
	tracking := sqlident.Qualify(schema, "schema_migrations")
	_, err := pool.Exec(ctx, `INSERT INTO `+tracking+` (version, name) VALUES (3, 'consumer_gate'), (7, 'dedup_scope')`)
	require.NoError(t, err)

	err = migrations.Up(ctx, pool, cfg)
	require.ErrorContains(t, err, "003_consumer_gate, 007_dedup_scope")
	require.ErrorContains(t, err, "migrate down -all")
	require.ErrorContains(t, migrations.Down(ctx, pool, cfg, 0), "pre-release eventline")
	require.Zero(t, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'held_events'`, schema), "nothing applied")
	require.Equal(t, 4, pgtest.Count(t, pool, `SELECT count(*) FROM `+tracking), "nothing rolled back")

	// Rolled back by the build that wrote it (every table dropped, the
	// tracking rows deleted), the schema takes this one's.
	pgtest.DropSchema(t, schema)
	require.NoError(t, migrations.Up(ctx, pool, cfg))
	st, err := migrations.Status(ctx, pool, cfg)
	require.NoError(t, err)
	for _, s := range st {
		require.True(t, s.Applied(), "%03d_%s", s.Version, s.Name)
	}
}

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
