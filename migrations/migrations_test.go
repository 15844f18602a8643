package migrations_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

func TestUpDownStatusRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.NewSchemaName(t)
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
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
	pool := pgtest.Pool(t, 2)
	schema := pgtest.NewSchemaName(t)
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
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
