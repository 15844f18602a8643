package admin_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/producer"
)

// TestReadShardCountRefusesBadInput: a nil handle is an error, not a
// panic, and a schema that is not a plain identifier is refused before any
// SQL, naming the argument, like every admin function does.
func TestReadShardCountRefusesBadInput(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	ctx := context.Background()

	_, err := admin.ReadShardCount(ctx, nil, env.Schema)
	require.ErrorContains(t, err, "db is nil")
	var nilPool *pgxpool.Pool
	_, err = admin.ReadShardCount(ctx, nilPool, env.Schema)
	require.ErrorContains(t, err, "db is nil")

	for _, schema := range []string{"", `x"; DROP TABLE y; --`, "x; drop table y", strings.Repeat("s", 64), "pg_x"} {
		_, err := admin.ReadShardCount(ctx, env.Pool, schema)
		require.ErrorContains(t, err, "schema", schema)
		require.NotErrorIs(t, err, producer.ErrNotMigrated, "%q is not a schema to migrate", schema)
	}
	n, err := admin.ReadShardCount(ctx, env.Pool, env.Schema)
	require.NoError(t, err)
	require.Equal(t, env.Shards, n)
}

// TestOperationsRefuseANilHandle: the operator functions (what
// `eventline status`, `held`, `cleanup` and the recovery commands call)
// panicked on a nil handle; each returns an error naming itself and the
// argument.
func TestOperationsRefuseANilHandle(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	ctx := context.Background()
	var nilPool *pgxpool.Pool
	calls := map[string]func() error{
		"admin.ListHeld: db is nil": func() error {
			_, err := admin.ListHeld(ctx, nilPool, env.Schema, admin.HeldFilter{})
			return err
		},
		"admin.ReplayHeld: db is nil": func() error {
			_, err := admin.ReplayHeld(ctx, nilPool, env.Schema, admin.HeldFilter{IDs: []int64{1}})
			return err
		},
		"admin.DiscardHeld: db is nil": func() error {
			_, err := admin.DiscardHeld(ctx, nilPool, env.Schema, admin.HeldFilter{IDs: []int64{1}}, "r")
			return err
		},
		"admin.Cleanup: db is nil": func() error {
			_, err := admin.Cleanup(ctx, nilPool, admin.CleanupConfig{Schema: env.Schema, Shards: []int{0}})
			return err
		},
		"admin.ReadOutboxStatus: db is nil": func() error {
			_, err := admin.ReadOutboxStatus(ctx, nilPool, env.Schema)
			return err
		},
		"admin.ReadHorizonHolder: db is nil": func() error {
			_, err := admin.ReadHorizonHolder(ctx, nilPool)
			return err
		},
		"admin.ShardOwners: db is nil": func() error {
			_, err := admin.ShardOwners(ctx, nilPool, env.Schema)
			return err
		},
		"admin.CheckPositions: db is nil": func() error {
			_, err := admin.CheckPositions(ctx, nilPool, env.Schema)
			return err
		},
		"admin.RebasePositions: db is nil": func() error {
			_, err := admin.RebasePositions(ctx, nilPool, env.Schema, true)
			return err
		},
		"admin.AdvanceSequences: producerDB is nil": func() error {
			_, err := admin.AdvanceSequences(ctx, nilPool, env.Schema, env.Pool, env.Schema, true)
			return err
		},
		"admin.AdvanceSequences: consumerDB is nil": func() error {
			_, err := admin.AdvanceSequences(ctx, env.Pool, env.Schema, nilPool, env.Schema, true)
			return err
		},
	}
	for want, call := range calls {
		var err error
		require.NotPanics(t, func() { err = call() }, want)
		require.ErrorContains(t, err, want)
	}
}

// TestOperationsNameABadSchema: a schema that is not a plain identifier is
// refused before any SQL, the error naming the function and the argument.
func TestOperationsNameABadSchema(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	ctx := context.Background()
	const bad = `x"; DROP TABLE y; --`
	calls := map[string]func() error{
		"admin.ReadStatus: schema":       func() error { _, err := admin.ReadStatus(ctx, env.Pool, bad, 0); return err },
		"admin.ReadOutboxStatus: schema": func() error { _, err := admin.ReadOutboxStatus(ctx, env.Pool, bad); return err },
		"admin.ShardOwners: schema":      func() error { _, err := admin.ShardOwners(ctx, env.Pool, bad); return err },
		"admin.CheckPositions: schema":   func() error { _, err := admin.CheckPositions(ctx, env.Pool, bad); return err },
		"admin.RebasePositions: schema":  func() error { _, err := admin.RebasePositions(ctx, env.Pool, bad, true); return err },
		"admin.ListHeld: schema": func() error {
			_, err := admin.ListHeld(ctx, env.Pool, bad, admin.HeldFilter{})
			return err
		},
		"admin.ReplayHeld: schema": func() error { _, err := admin.ReplayHeld(ctx, env.Pool, bad, admin.HeldFilter{}); return err },
		"admin.DiscardHeld: schema": func() error {
			_, err := admin.DiscardHeld(ctx, env.Pool, bad, admin.HeldFilter{}, "r")
			return err
		},
		"admin.AdvanceSequences: consumerSchema": func() error {
			_, err := admin.AdvanceSequences(ctx, env.Pool, env.Schema, env.Pool, bad, true)
			return err
		},
		"admin.CleanupConfig.Schema": func() error {
			_, err := admin.Cleanup(ctx, env.Pool, admin.CleanupConfig{Schema: bad})
			return err
		},
		"admin.NewStatusCollector: schema": func() error { _, err := admin.NewStatusCollector(env.Pool, bad); return err },
	}
	for want, call := range calls {
		require.ErrorContains(t, call(), want)
	}
}
