package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// laterMigrations returns the migrations numbered version or later,
// newest first: what `migrate down` rolls back to undo version.
func laterMigrations(t testing.TB, version int) []migrations.Migration {
	t.Helper()
	all, err := migrations.All()
	require.NoError(t, err)
	var later []migrations.Migration
	for i := len(all) - 1; i >= 0 && all[i].Version >= version; i-- {
		later = append(later, all[i])
	}
	return later
}

// stepsFrom returns how many migrations `migrate down -steps` must roll
// back to undo version and every later one.
func stepsFrom(t testing.TB, version int) int { return len(laterMigrations(t, version)) }

// rolledBack is `migrate down`'s output for version and every later one.
func rolledBack(t testing.TB, version int) string {
	var b strings.Builder
	for _, m := range laterMigrations(t, version) {
		fmt.Fprintf(&b, "rolled back %03d_%s\n", m.Version, m.Name)
	}
	return b.String()
}

// versionOf returns the number of the migration called name.
func versionOf(t testing.TB, name string) int {
	t.Helper()
	all, err := migrations.All()
	require.NoError(t, err)
	i := slices.IndexFunc(all, func(m migrations.Migration) bool { return m.Name == name })
	require.GreaterOrEqual(t, i, 0, "no migration named %q", name)
	return all[i].Version
}

func TestMigrate(t *testing.T) {
	t.Parallel()

	t.Run("up, status, down round trip", func(t *testing.T) {
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
		all, err := migrations.All()
		require.NoError(t, err)
		st := okJSON[status](t, schema, "migrate", "status", "-json")
		require.Equal(t, schema, st.Schema)
		require.Len(t, st.Migrations, len(all))
		require.Equal(t, len(all), st.Pending)
		require.Equal(t, "outbox", st.Migrations[0].Name)
		require.Nil(t, st.Migrations[0].AppliedAt)

		r := cli(t, append(dbArgs(schema), "migrate", "status", "-check")...)
		require.Equal(t, exitFailure, r.code, "-check fails while migrations are pending")
		require.Contains(t, r.stdout, "run `eventline migrate up`")

		out := ok(t, schema, "migrate", "up", "-shards", "3")
		require.Contains(t, out, "applied 001_outbox\napplied 002_consumer\n")
		require.Contains(t, out, "3 outbox shards")
		n, err := admin.ReadShardCount(ctx, pool, schema)
		require.NoError(t, err)
		require.Equal(t, 3, n)

		out = ok(t, schema, "migrate", "up")
		require.Contains(t, out, fmt.Sprintf("already up to date (%d migrations, 3 outbox shards)", len(all)))
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
		last := all[len(all)-1]
		lastLine := fmt.Sprintf("rolled back %03d_%s\n", last.Version, last.Name)
		out = ok(t, schema, "migrate", "down")
		require.Equal(t, lastLine, out)
		if last.Version > 2 { // and the rest of the consumer side
			out = ok(t, schema, "migrate", "down", "-steps", strconv.Itoa(stepsFrom(t, 2)-1))
			require.Equal(t, strings.TrimPrefix(rolledBack(t, 2), lastLine), out)
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
		n, err = admin.ReadShardCount(ctx, pool, schema)
		require.NoError(t, err)
		require.Equal(t, 2, n)
	})

	t.Run("down refuses to drop parked events", func(t *testing.T) {
		t.Parallel()
		env := pgtest.New(t, pgtest.Options{Shards: 1})
		parkGap(t, env, "billing", "a", 1, 3)

		steps := strconv.Itoa(stepsFrom(t, 2))
		r := cli(t, append(dbArgs(env.Schema), "migrate", "down", "-steps", steps)...)
		require.Equal(t, exitFailure, r.code)
		require.Contains(t, r.stderr, "parked_events holds 1 event")
		require.Equal(t, 1, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, "parked_events")))

		out := ok(t, env.Schema, "migrate", "down", "-steps", steps, "-force")
		require.Equal(t, rolledBack(t, 2), out)
	})

	// Held events not yet replayed or discarded, of any kind, block rolling
	// back 003_held_events unless forced.
	t.Run("down refuses to drop held events", func(t *testing.T) {
		t.Parallel()
		env := pgtest.New(t, pgtest.Options{Shards: 1})
		ctx := context.Background()
		require.NoError(t, held.New(env.Schema).AddRelay(ctx, env.Pool, held.Event{Cause: held.CauseRejected, Reason: "r", MessageUUID: "u-1"}))

		steps := strconv.Itoa(stepsFrom(t, versionOf(t, "held_events")))
		r := cli(t, append(dbArgs(env.Schema), "migrate", "down", "-steps", steps)...)
		require.Equal(t, exitFailure, r.code)
		require.Contains(t, r.stderr, "held_events holds 1 event not yet replayed or discarded")
		require.Contains(t, r.stderr, "eventline held list")
		ok(t, env.Schema, "held", "discard", "-reason", "test", "-kind", "relay_dead_letter", "-all")
		require.Equal(t, rolledBack(t, versionOf(t, "held_events")), ok(t, env.Schema, "migrate", "down", "-steps", steps))
	})
}
