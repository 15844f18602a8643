package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/producer"
)

// ownWarnings drops the warning about a transaction holding the xmin
// horizon: any session of the cluster (another test) can cause it.
func ownWarnings(st statusJSON) []string {
	var out []string
	for _, w := range st.Warnings {
		if !strings.Contains(w, "wait behind an open transaction") {
			out = append(out, w)
		}
	}
	return out
}

// statusJSON mirrors the documented JSON of `eventline status -json`.
type statusJSON struct {
	Schema string `json:"schema"`
	Outbox struct {
		HorizonHolder *struct {
			PID             int32   `json:"pid"`
			State           string  `json:"state"`
			ApplicationName string  `json:"application_name"`
			XactAgeSeconds  float64 `json:"xact_age_seconds"`
		} `json:"horizon_holder"`
		Shards []struct {
			Shard                int     `json:"shard"`
			Backlog              int64   `json:"backlog"`
			OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
			Stored               int64   `json:"stored"`
			OwnerPID             *int32  `json:"owner_pid"`
			HeldBack             int64   `json:"held_back"`
			HeldBackBy           *int32  `json:"held_back_by_pid"`
		} `json:"shards"`
		Backlog              int64   `json:"backlog"`
		OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
		DeadLetters          int64   `json:"dead_letters"`
		Retrying             int64   `json:"retrying"`
		OwnedShards          int     `json:"owned_shards"`
	} `json:"outbox"`
	Groups []struct {
		Group               string  `json:"group"`
		Processed           int64   `json:"processed"`
		Parked              int64   `json:"parked"`
		OldestParkedSeconds float64 `json:"oldest_parked_seconds"`
		SkippedGaps         int64   `json:"skipped_gaps"`
		SkippedVersions     int64   `json:"skipped_versions"`
		// Gaps and stalls.
		OpenGaps             int64   `json:"open_gaps"`
		OldestOpenGapSeconds float64 `json:"oldest_open_gap_seconds"`
		OpenGapList          []struct {
			AggregateType string `json:"aggregate_type"`
			AggregateID   string `json:"aggregate_id"`
			Current       int64  `json:"current_version"`
			MissingFrom   int64  `json:"missing_from"`
			MissingTo     int64  `json:"missing_to"`
			Parked        int64  `json:"parked"`
		} `json:"open_gap_list"`
		SkippedGaps24h int64 `json:"skipped_gaps_24h"`
		LateEvents     int64 `json:"late_events"`
		DeadLetters    int64 `json:"dead_letters"`
	} `json:"consumer_groups"`
	Warnings []string `json:"warnings"`
}

func TestStatus(t *testing.T) {
	t.Parallel()

	t.Run("reports backlog, dead letters and groups", func(t *testing.T) {
		t.Parallel()
		const shards = 3
		env := pgtest.New(t, pgtest.Options{Shards: shards})
		ctx := context.Background()

		var ids []string
		perShard := make([]int64, shards)
		for i := range 10 {
			id := "order-" + strconv.Itoa(i)
			ids = append(ids, id)
			perShard[outbox.ShardFor("order", id, shards)]++
		}
		publish(t, env, "orders", ids...)
		_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+
			` (kind, shard, message_uuid, payload, header_keys, header_values, attempts, last_error, cause, reason)
			VALUES ('relay_dead_letter', 0, 'u-1', '', '{}', '{}', 3, 'boom', 'retries_exhausted', 'gave up after 3 attempts')`)
		require.NoError(t, err)
		// billing applied a v1, v2 and parked v4; shipping parked x v3, then an
		// operator gave up on x v1..v2.
		parkGap(t, env, "billing", "a", 2, 4)
		parkGap(t, env, "shipping", "x", 0, 3)
		gates, err := store.New(env.Schema)
		require.NoError(t, err)
		_, err = gates.ReleaseGap(ctx, env.Pool, "shipping", "thing", "x", "test")
		require.NoError(t, err)

		st := okJSON[statusJSON](t, env.Schema, "status", "-json")
		require.Equal(t, env.Schema, st.Schema)
		require.EqualValues(t, 10, st.Outbox.Backlog)
		require.Len(t, st.Outbox.Shards, shards)
		for i, s := range st.Outbox.Shards {
			require.Equal(t, i, s.Shard)
			require.Equal(t, perShard[i], s.Backlog, "shard %d", i)
			require.Equal(t, perShard[i], s.Stored, "shard %d", i)
			require.Nil(t, s.OwnerPID, "no relay runs")
			require.GreaterOrEqual(t, s.OldestPendingSeconds, 0.0)
		}
		require.EqualValues(t, 1, st.Outbox.DeadLetters)
		require.Zero(t, st.Outbox.Retrying)
		require.Zero(t, st.Outbox.OwnedShards)
		require.Empty(t, ownWarnings(st))
		require.Len(t, st.Groups, 2)
		billing, shipping := st.Groups[0], st.Groups[1]
		require.Equal(t, "billing", billing.Group)
		require.EqualValues(t, 3, billing.Processed, "v1, v2 applied and v4 parked are recorded")
		require.EqualValues(t, 1, billing.Parked)
		require.Zero(t, billing.SkippedGaps)
		require.Equal(t, "shipping", shipping.Group)
		require.EqualValues(t, 1, shipping.Processed)
		require.EqualValues(t, 1, shipping.Parked)
		require.EqualValues(t, 1, shipping.SkippedGaps)
		require.EqualValues(t, 2, shipping.SkippedVersions)

		out := ok(t, env.Schema, "status")
		require.Contains(t, out, fmt.Sprintf("Outbox (schema %s): 3 shards, backlog 10, oldest pending ", env.Schema))
		require.Contains(t, out, "0 of 3 shards owned by a relay")
		require.Regexp(t, `SHARD\s+BACKLOG\s+HELD BACK\s+OLDEST PENDING\s+STORED\s+OWNER`, out)
		// HELD BACK depends on every open transaction in the cluster (other
		// tests' too); TestStatusNamesTheTransactionHoldingEventsBack checks it.
		for i, n := range perShard {
			require.Regexp(t, fmt.Sprintf(`(?m)^%d\s+%d\s+\d+\s+\S+\s+%d\s+-$`, i, n, n), out)
		}
		require.Contains(t, out, "Dead letters waiting: 1 (eventline held list -kind relay_dead_letter)")
		require.Contains(t, out, "Retrying: 0")
		require.Contains(t, out, "No relay owns a shard: start one with `eventline relay`.")
		require.Regexp(t, `GROUP\s+DEDUP ROWS\s+PARKED\s+OLDEST PARKED\s+SKIPPED GAPS\s+SKIPPED VERSIONS`, out)
		require.Regexp(t, `(?m)^billing\s+3\s+1\s+\S+\s+0\s+0$`, out)
		require.Regexp(t, `(?m)^shipping\s+1\s+1\s+\S+\s+1\s+2$`, out)
		require.Contains(t, out, "eventline parked list")
	})

	t.Run("on an incomplete schema", func(t *testing.T) {
		t.Parallel()
		schema := pgtest.NewSchemaName(t)
		t.Cleanup(func() { pgtest.DropSchema(t, schema) })

		r := cli(t, append(dbArgs(schema), "status")...)
		require.Equal(t, exitFailure, r.code)
		require.Contains(t, r.stderr, "eventline status: ")
		require.Contains(t, r.stderr, "run `eventline migrate up`")

		// Rolled back part of the way: refused the same way.
		ok(t, schema, "migrate", "up", "-shards", "1")
		ok(t, schema, "migrate", "down", "-steps", strconv.Itoa(stepsFrom(t, 2)))
		r = cli(t, append(dbArgs(schema), "status")...)
		require.Equal(t, exitFailure, r.code)
		require.Contains(t, r.stderr, "run `eventline migrate up`")
	})

	// An outbox moved to a cluster with a lower transaction counter is
	// reported by status (text and JSON) with the command that repairs it, and
	// the command repairs it.
	t.Run("warns when positions are ahead, and rebase fixes them", func(t *testing.T) {
		t.Parallel()
		env := pgtest.New(t, pgtest.Options{Shards: 2})
		_, err := env.Pool.Exec(context.Background(), `INSERT INTO `+sqlident.Qualify(env.Schema, outbox.OffsetsTable(1))+
			` (consumer_group, offset_acked, last_processed_transaction_id)
			VALUES ($1, 7, ((pg_snapshot_xmax(pg_current_snapshot())::text::bigint) + 1000000)::text::xid8)`, outbox.RelayConsumerGroup)
		require.NoError(t, err)

		st := okJSON[statusJSON](t, env.Schema, "status", "-json")
		require.Len(t, ownWarnings(st), 1)
		require.Contains(t, ownWarnings(st)[0], "shard 1")
		require.Contains(t, ownWarnings(st)[0], "eventline relay rebase-positions")
		out := ok(t, env.Schema, "status")
		require.Contains(t, out, "warning: shard 1")

		out = ok(t, env.Schema, "relay", "rebase-positions", "-dry-run")
		require.Contains(t, out, "shard 1: would re-base")
		require.Contains(t, ok(t, env.Schema, "status"), "warning: shard 1", "a dry run changes nothing")
		out = ok(t, env.Schema, "relay", "rebase-positions")
		require.Contains(t, out, "shard 1: re-based")
		st = okJSON[statusJSON](t, env.Schema, "status", "-json")
		require.Empty(t, ownWarnings(st))
		out = ok(t, env.Schema, "relay", "rebase-positions")
		require.Contains(t, out, "nothing to do")
	})

	// Per group, status lists the open gaps (aggregate, missing versions,
	// age), the gaps skipped in the last day, late events and unresolved dead
	// letters, in text and JSON. Before: no "Gaps and stalls" section and no
	// such fields.
	t.Run("shows gaps and stalls", func(t *testing.T) {
		t.Parallel()
		env := pgtest.New(t, pgtest.Options{Shards: 1})
		ctx := context.Background()
		parkGap(t, env, "billing", "a1", 1, 4, 5) // waits for v2..v3
		parkGap(t, env, "shipping", "b", 0, 2)    // waits for v1
		ok(t, env.Schema, "parked", "release", "-reason", "lost", "shipping", "thing/b")
		_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+
			` (kind, consumer_group, message_uuid, payload, header_keys, header_values, cause, reason)
			VALUES ('dead_letter', 'billing', '\x01', '\x00', '{}', '{}', 'permanent', 'r')`)
		require.NoError(t, err)

		st := okJSON[statusJSON](t, env.Schema, "status", "-json")
		require.Len(t, st.Groups, 2)
		b, s := st.Groups[0], st.Groups[1]
		require.Equal(t, "billing", b.Group)
		require.EqualValues(t, 1, b.OpenGaps)
		require.Positive(t, b.OldestOpenGapSeconds)
		require.Len(t, b.OpenGapList, 1)
		g := b.OpenGapList[0]
		require.Equal(t, []any{"thing", "a1", int64(1), int64(2), int64(3), int64(2)}, []any{g.AggregateType, g.AggregateID, g.Current, g.MissingFrom, g.MissingTo, g.Parked})
		require.EqualValues(t, 1, b.DeadLetters)
		require.Equal(t, "shipping", s.Group)
		require.Zero(t, s.OpenGaps, "released: the parked event is ready, no gap")
		require.EqualValues(t, 1, s.SkippedGaps24h)

		out := ok(t, env.Schema, "status")
		require.Contains(t, out, "Gaps and stalls:")
		require.Regexp(t, `billing: 1 open gap \(oldest \S+\), 0 gaps skipped in the last 24h, 0 late events held, 1 dead letter not resolved`, out)
		require.Regexp(t, `thing/a1 at version 1, waiting for versions 2\.\.3 for \S+ \(2 parked events\)`, out)
		require.Regexp(t, `shipping: 0 open gaps, 1 gap skipped in the last 24h`, out)
		require.Contains(t, out, "eventline parked list")
	})
}

// TestStatusNamesTheTransactionHoldingEventsBack: while an open transaction
// holds the xmin horizon, status counts the committed events it holds back
// per shard and names it (pid, state, age, application), with how to end
// it. Not parallel: the open transaction holds back every test's events.
func TestStatusNamesTheTransactionHoldingEventsBack(t *testing.T) {
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	holder, err := env.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer holder.Release()
	_, err = holder.Exec(ctx, `SET application_name = 'horizon-holder-test'`)
	require.NoError(t, err)
	tx, err := holder.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	var pid int32
	var xid string
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid(), pg_current_xact_id()::text`).Scan(&pid, &xid))

	p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders"})
	require.NoError(t, err)
	e, err := eventline.NewJSONEvent("order.created", "order", "a", map[string]int{"n": 1})
	require.NoError(t, err)
	require.NoError(t, p.Publish(ctx, env.Pool, e))

	st := okJSON[statusJSON](t, env.Schema, "status", "-json")
	require.EqualValues(t, 1, st.Outbox.Shards[0].HeldBack)
	h := st.Outbox.HorizonHolder
	require.NotNil(t, h)
	if h.PID == pid { // another, older transaction elsewhere in the cluster would be named instead
		require.Equal(t, "horizon-holder-test", h.ApplicationName)
		require.Equal(t, "idle in transaction", h.State)
	}
	require.NotEmpty(t, st.Warnings)
	require.Contains(t, st.Warnings[len(st.Warnings)-1], "pg_terminate_backend")
	require.NotNil(t, st.Outbox.Shards[0].HeldBackBy)
	require.Equal(t, h.PID, *st.Outbox.Shards[0].HeldBackBy)
	out := ok(t, env.Schema, "status")
	require.Regexp(t, `(?m)^0\s+1\s+1\s`, out)
	require.Contains(t, out, "Gaps and stalls:")
	require.Regexp(t, `shard 0: 1 committed event held back by pid \d+ \(`, out)
	if h.PID == pid {
		require.Contains(t, out, "query started ")
	}

	require.NoError(t, tx.Rollback(ctx))
	require.Eventually(t, func() bool {
		st := okJSON[statusJSON](t, env.Schema, "status", "-json")
		return st.Outbox.Shards[0].HeldBack == 0 && st.Outbox.HorizonHolder == nil
	}, 30*time.Second, 100*time.Millisecond)
}
