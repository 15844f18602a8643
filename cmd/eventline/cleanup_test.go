package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
)

func TestCleanupOutboxAndDedup(t *testing.T) {
	t.Parallel()
	b := setup(t, 2, 2)
	env, ctx := b.env, context.Background()
	publish(t, env, b.topic, "a", "b", "c", "d", "e")
	relay := start(t, b.relayArgs()...)
	waitDrained(t, env)
	require.Equal(t, exitOK, relay.stop(t))
	unsent := publish(t, env, b.topic, "f") // never relayed: cleanup keeps it

	// billing has applied a v1, v2 and parked v4; shipping applied z v1.
	// Every record is two days old.
	parkGap(t, env, "billing", "a", 2, 4)
	parkGap(t, env, "shipping", "z", 1)
	processed := sqlident.Qualify(env.Schema, "processed_events")
	_, err := env.Pool.Exec(ctx, `UPDATE `+processed+` SET processed_at = now() - interval '2 days'`)
	require.NoError(t, err)
	stored := func() int {
		n := 0
		for _, s := range okJSON[statusJSON](t, env.Schema, "status", "-json").Outbox.Shards {
			n += int(s.Stored)
		}
		return n
	}
	require.Equal(t, 6, stored())

	type report struct {
		DryRun bool `json:"dry_run"`
		Outbox *struct {
			Deleted  int64            `json:"deleted"`
			PerShard map[string]int64 `json:"per_shard"`
		} `json:"outbox"`
		Dedup *struct {
			Group   string `json:"group"`
			Deleted int64  `json:"deleted"`
			Batches int    `json:"batches"`
		} `json:"dedup"`
	}
	args := []string{"cleanup", "-retention", "1ms", "-dedup-retention", "24h", "-batch", "1", "-pause", "0s"}

	dry := okJSON[report](t, env.Schema, append(args, "-dry-run", "-json")...)
	require.True(t, dry.DryRun)
	require.EqualValues(t, 5, dry.Outbox.Deleted, "the relayed rows")
	require.EqualValues(t, 3, dry.Dedup.Deleted, "every record but the parked one")
	require.Equal(t, 6, stored(), "a dry run deletes nothing")
	require.Equal(t, 4, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+processed))

	one := okJSON[report](t, env.Schema, "cleanup", "-only", "dedup", "-group", "shipping", "-dedup-retention", "24h", "-json")
	require.Nil(t, one.Outbox, "-only dedup")
	require.Equal(t, "shipping", one.Dedup.Group)
	require.EqualValues(t, 1, one.Dedup.Deleted)
	require.Equal(t, 3, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+processed+` WHERE consumer_group = 'billing'`))

	out := ok(t, env.Schema, args...)
	require.Regexp(t, `outbox: deleted 5 rows written more than 1ms ago and already relayed \(shard 0: \d, shard 1: \d\)`, out)
	require.Regexp(t, `dedup: deleted 2 records processed before \S+ \S+ \(all groups, 3 batches\)`, out)
	require.Equal(t, 1, stored(), "only the unrelayed row is left")
	require.Equal(t, 1, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+processed+` WHERE outcome = 'parked'`))
	require.Equal(t, 1, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+processed))
	st := okJSON[statusJSON](t, env.Schema, "status", "-json")
	require.EqualValues(t, 1, st.Outbox.Backlog, "event %s still waits for a relay", unsent[0].ID)

	out = ok(t, env.Schema, "cleanup", "-only", "outbox")
	require.Contains(t, out, "outbox: deleted 0 rows written more than 24h ago")
	require.NotContains(t, out, "dedup")
}
