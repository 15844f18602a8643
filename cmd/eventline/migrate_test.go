package main

import (
	"context"
	"fmt"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// aboveOutbox is the number of migrations after 001_outbox (the consumer
// tables and whatever follows), so tests can roll back to the outbox alone
// however many migrations there are.
func aboveOutbox(t testing.TB) int {
	t.Helper()
	all, err := migrations.All()
	require.NoError(t, err)
	return len(all) - 1
}

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
	count := aboveOutbox(t) + 1
	st := okJSON[status](t, schema, "migrate", "status", "-json")
	require.Equal(t, schema, st.Schema)
	require.Len(t, st.Migrations, count)
	require.Equal(t, count, st.Pending)
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
	require.Contains(t, out, fmt.Sprintf("already up to date (%d migrations, 3 outbox shards)", count))
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
	last := st.Migrations[count-1]
	out = ok(t, schema, "migrate", "down")
	require.Equal(t, fmt.Sprintf("rolled back %03d_%s\n", last.Version, last.Name), out)
	if count > 2 {
		out = ok(t, schema, "migrate", "down", "-steps", strconv.Itoa(count-2))
		require.Contains(t, out, "rolled back 002_consumer\n")
	}
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

	r := cli(t, append(dbArgs(env.Schema), "migrate", "down", "-steps", strconv.Itoa(aboveOutbox(t)))...)
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "parked_events holds 1 event")
	require.Equal(t, 1, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, "parked_events")))

	out := ok(t, env.Schema, "migrate", "down", "-steps", strconv.Itoa(aboveOutbox(t)), "-force")
	require.Contains(t, out, "rolled back 002_consumer\n")
}

func TestMigrateDownRefusesToDropLateEvents(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	store, err := versioning.NewStore(env.Schema)
	require.NoError(t, err)
	k := versioning.Key{Group: "billing", AggregateType: "thing", AggregateID: "a"}
	require.NoError(t, store.RecordSkipped(ctx, env.Pool, k, 2, 2, "park timeout"))
	late, _, err := store.HoldLate(ctx, env.Pool, versioning.LateRequest{Group: "billing", Event: consumertest.Event("a", 2), Current: 3, Hold: true})
	require.NoError(t, err)
	require.True(t, late)

	r := cli(t, append(dbArgs(env.Schema), "migrate", "down", "-all")...)
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "late_events holds 1 event")
	require.Contains(t, r.stderr, "eventline parked late")
}
