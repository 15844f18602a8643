package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

func TestMigrateUpStatusDownRoundTrip(t *testing.T) {
	t.Parallel()
	schema := pgtest.NewSchemaName(t)
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	pool := pgtest.Pool(t, 2)
	ctx := context.Background()

	type status struct {
		Schema     string `json:"schema"`
		Pending    int    `json:"pending"`
		Migrations []struct {
			Version   int     `json:"version"`
			Name      string  `json:"name"`
			Applied   bool    `json:"applied"`
			AppliedAt *string `json:"applied_at"`
		} `json:"migrations"`
	}
	st := okJSON[status](t, schema, "migrate", "status", "-json")
	require.Equal(t, schema, st.Schema)
	require.Len(t, st.Migrations, 2)
	require.Equal(t, 2, st.Pending)
	require.Equal(t, "outbox", st.Migrations[0].Name)
	require.Nil(t, st.Migrations[0].AppliedAt)

	r := cli(t, append(dbArgs(schema), "migrate", "status", "-check")...)
	require.Equal(t, exitFailure, r.code, "-check fails while migrations are pending")
	require.Contains(t, r.stdout, "run `eventline migrate up`")

	out := ok(t, schema, "migrate", "up", "-shards", "3")
	require.Contains(t, out, "applied 001_outbox\napplied 002_consumer\n")
	require.Contains(t, out, "3 outbox shards")
	n, err := producer.ReadShardCount(ctx, pool, schema)
	require.NoError(t, err)
	require.Equal(t, 3, n)

	out = ok(t, schema, "migrate", "up")
	require.Contains(t, out, "already up to date (2 migrations, 3 outbox shards)")
	r = cli(t, append(dbArgs(schema), "migrate", "up", "-shards", "5")...)
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "omit -shards")

	st = okJSON[status](t, schema, "migrate", "status", "-json")
	require.Zero(t, st.Pending)
	require.True(t, st.Migrations[1].Applied)
	require.NotNil(t, st.Migrations[1].AppliedAt)
	out = ok(t, schema, "migrate", "status", "-check")
	require.Regexp(t, `002\s+consumer\s+\d{4}-\d\d-\d\d`, out)

	// down rolls back one migration by default.
	out = ok(t, schema, "migrate", "down")
	require.Equal(t, "rolled back 002_consumer\n", out)
	require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'processed_events'`, schema))
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'outbox_0'`, schema))
	out = ok(t, schema, "migrate", "status")
	require.Regexp(t, `002\s+consumer\s+pending`, out)

	// Unsent events block dropping the outbox unless forced.
	_, err = pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(schema, "outbox_0")+
		` (uuid, payload, metadata, transaction_id) VALUES ('u1', '{}', '{}', pg_current_xact_id())`)
	require.NoError(t, err)
	r = cli(t, append(dbArgs(schema), "migrate", "down")...)
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "refusing to roll back 001_outbox")
	require.Contains(t, r.stderr, "-force")
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM `+sqlident.Qualify(schema, "outbox_0")))

	out = ok(t, schema, "migrate", "down", "-all", "-force")
	require.Equal(t, "rolled back 001_outbox\n", out)
	require.Equal(t, 0, pgtest.Count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename <> 'schema_migrations'`, schema))
	out = ok(t, schema, "migrate", "down")
	require.Contains(t, out, "nothing to roll back")

	// And back up again: the round trip leaves a working schema.
	ok(t, schema, "migrate", "up", "-shards", "2")
	n, err = producer.ReadShardCount(ctx, pool, schema)
	require.NoError(t, err)
	require.Equal(t, 2, n)
}

func TestMigrateDownRefusesToDropParkedEvents(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	parkGap(t, env, "billing", "a", 1, 3)

	r := cli(t, append(dbArgs(env.Schema), "migrate", "down")...)
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "parked_events holds 1 event")
	require.Equal(t, 1, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, "parked_events")))

	out := ok(t, env.Schema, "migrate", "down", "-steps", "1", "-force")
	require.Equal(t, "rolled back 002_consumer\n", out)
}
