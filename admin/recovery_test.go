package admin_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// TestRebasePositionsNeverMarksAConcurrentCommitRelayed: producers keep
// writing while `eventline relay rebase-positions` runs. A producer that
// takes its transaction id after the re-base read the cluster's counter,
// and commits before the rows are moved, wrote a row whose id is at or
// above that counter: before the fix the re-base took it for a row of the
// old cluster, gave it id 0 ("relayed before the move") and set the
// position on it, so the relay never sent it. A producer that took its id
// before the re-base began may sit at or above the counter too (it is one
// past the newest completed transaction); one still in flight while the
// rows are moved commits after the re-base. Every one of these events must
// be relayed, with the old cluster's unsent one.
func TestRebasePositionsNeverMarksAConcurrentCommitRelayed(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	ctx := context.Background()
	cfg := producer.RelayConfig{Schema: env.Schema, Brokers: brokers, PollInterval: 200 * time.Millisecond,
		RebalanceInterval: 250 * time.Millisecond, Logger: relaytest.Logger(t)}

	before := relaytest.PublishOrders(t, env, topic, 1, 3, 3)
	_, stop := relaytest.Run(t, env.Pool, cfg)
	relaytest.RequireAllDelivered(t, brokers, topic, relaytest.IDs(before), 30*time.Second)
	stop()
	unsent := relaytest.PublishOrders(t, env, topic, 1, 1, 1)
	relaytest.MoveToAHigherCounterCluster(t, env, 0)

	p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic})
	require.NoError(t, err)
	committed := relaytest.Event(t, "agg-0", topic, "committed while the re-base ran")
	inFlight := relaytest.Event(t, "agg-1", topic, "in flight while the re-base ran")
	// This one took its id before the re-base began: the counter, one past
	// the newest completed transaction, may be at or below it.
	early := relaytest.Event(t, "agg-2", topic, "begun before the re-base, committed while it ran")
	earlyTx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = earlyTx.Rollback(ctx) }()
	require.NoError(t, p.PublishTx(ctx, earlyTx, early))
	var open pgx.Tx
	restore := admin.SetRebaseHook(func(schema string, _ int) {
		if schema != env.Schema {
			return
		}
		require.NoError(t, earlyTx.Commit(ctx))
		// The re-base has read the counter. This transaction takes a
		// newer id, and commits before the rows are moved.
		require.NoError(t, p.Publish(ctx, env.Pool, committed))
		// This one writes its row and stays open while they are moved.
		var err error
		open, err = env.Pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, p.PublishTx(ctx, open, inFlight))
	})
	res, err := admin.RebasePositions(ctx, env.Pool, env.Schema, false)
	restore()
	require.NoError(t, err)
	require.NotNil(t, open, "the hook ran")
	require.NoError(t, open.Commit(ctx))

	// Every one of those rows sorts after the new position.
	var rows, behind int
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE
			(m.transaction_id, m."offset") <= (o.last_processed_transaction_id, o.offset_acked)) FROM `+sqlident.Qualify(env.Schema, outbox.Table(0))+` m, `+
		sqlident.Qualify(env.Schema, outbox.OffsetsTable(0))+` o
		WHERE o.consumer_group = $1 AND m.payload->>'uuid' = ANY($2)`, outbox.RelayConsumerGroup, []string{committed.ID, inFlight.ID, early.ID}).Scan(&rows, &behind))
	require.Equal(t, 3, rows)
	require.Zero(t, behind, "an event committed during the re-base is at or before the relay's position: it will never be sent")
	require.True(t, res[0].Ahead())
	require.EqualValues(t, 3, res[0].Relayed, "only the rows relayed on the old cluster count as relayed")
	require.EqualValues(t, 1, res[0].Pending)

	_, stop = relaytest.Run(t, env.Pool, cfg)
	relaytest.RequireAllDelivered(t, brokers, topic, append(relaytest.IDs(unsent), committed.ID, inFlight.ID, early.ID), 30*time.Second)
	stop()
}

// TestAdvanceSequencesCountsEveryVersionConsumersHold: after a failover
// that lost commits, a consumer group may hold a version not only as
// applied or parked but as a late event or a dead letter (the dead letter
// of the newest version, say, while later ones wait). Before the fix
// AdvanceSequences read only aggregate_versions and parked_events, left
// the sequence below the dead letter's version, and the next event took
// that version too. A dead letter whose envelope did not decode holds no
// version; one whose aggregate key is too long for the sequences' index
// (a hostile record) could never have been published, and is left out
// instead of failing the whole run.
func TestAdvanceSequencesCountsEveryVersionConsumersHold(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := env.Pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	q := func(table string) string { return sqlident.Qualify(env.Schema, table) }
	exec(`INSERT INTO ` + q("aggregate_sequences") + ` VALUES ('order','a',3)`)
	exec(`INSERT INTO ` + q("aggregate_versions") + ` (consumer_group, aggregate_type, aggregate_id, version)
		VALUES ('billing','order','a',7), ('billing','order','d',2)`)
	exec(`INSERT INTO ` + q("held_events") + ` (kind, cause, reason, consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version,
			previous_version, event_type, message_uuid, payload, header_keys, header_values, current_version)
		VALUES ('late', 'passed', 'passed while parked', 'billing', 'e9', 'order', 'd', 9, 8, 'order.updated', '\x00', '\x7b7d', '{}', '{}', 10)`)
	dead := func(group, typ, id string, version int64, status string) {
		t.Helper()
		exec(`INSERT INTO `+q("held_events")+` (kind, consumer_group, message_uuid, payload, header_keys, header_values,
				event_id, aggregate_type, aggregate_id, aggregate_version, cause, reason, status)
			VALUES ('dead_letter', $1, '\x00', '\x00', '{}', '{}', 'ev', $2, $3, $4, 'permanent', 'test', $5)`, group, typ, id, version, status)
	}
	dead("billing", "order", "a", 12, "held")         // waits for the operator
	dead("shipping", "order", "e", 15, "discarded")   // given up on, but its version was used
	dead("shipping", "order", "f", 4, "replayed")     // applied or held elsewhere since; counts all the same
	dead("shipping", "", "", 0, "held")               // did not decode: no version
	dead("shipping", "order", hugeKey(t), 99, "held") // a hostile record's key

	res, err := admin.AdvanceSequences(ctx, env.Pool, env.Schema, env.Pool, env.Schema, false)
	require.NoError(t, err)
	require.Equal(t, admin.SequenceAdvance{Aggregates: 5, Advanced: 4, KeysTooLong: 1}, res)
	seq := func(id string) int {
		return pgtest.Count(t, env.Pool, `SELECT version FROM `+q("aggregate_sequences")+` WHERE aggregate_type = 'order' AND aggregate_id = $1`, id)
	}
	require.Equal(t, 12, seq("a"), "the dead letter's version, not the applied one below it")
	require.Equal(t, 9, seq("d"), "the late event's version")
	require.Equal(t, 15, seq("e"), "a discarded dead letter's version was used")
	require.Equal(t, 4, seq("f"))

	p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders"})
	require.NoError(t, err)
	require.NoError(t, p.Publish(ctx, env.Pool, relaytest.Event(t, "a", "orders", 1)))
	require.Equal(t, 13, seq("a"), "the next event follows the version held as a dead letter")
}

// hugeKey returns an aggregate id no PostgreSQL index can hold.
func hugeKey(t *testing.T) string {
	var b [8 << 10]byte
	_, err := rand.Read(b[:])
	require.NoError(t, err)
	return hex.EncodeToString(b[:])
}

// TestAdvanceSequencesMovesPastWhatConsumersSaw: after a failover that lost
// commits, the producer's sequences are behind versions consumers applied
// or parked; AdvanceSequences moves them up (never down), reading the
// consumer tables from wherever they live.
func TestAdvanceSequencesMovesPastWhatConsumersSaw(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, separate := range []bool{false, true} {
		t.Run(fmt.Sprintf("separate=%v", separate), func(t *testing.T) {
			env := pgtest.New(t, pgtest.Options{Shards: 1})
			consumers := env
			if separate {
				consumers = pgtest.New(t, pgtest.Options{Shards: 1}) // stands for the consumers' own database
			}
			exec := func(env pgtest.Env, sql string) {
				_, err := env.Pool.Exec(ctx, sql)
				require.NoError(t, err)
			}
			exec(env, `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_sequences")+` VALUES ('order','a',3), ('order','c',10)`)
			exec(consumers, `INSERT INTO `+sqlident.Qualify(consumers.Schema, "aggregate_versions")+
				` (consumer_group, aggregate_type, aggregate_id, version) VALUES ('billing','order','a',7), ('shipping','order','a',6), ('billing','order','c',2)`)
			exec(consumers, `INSERT INTO `+sqlident.Qualify(consumers.Schema, "parked_events")+
				` (consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type, payload, metadata)
				VALUES ('billing','order','b',5,4,'e5','order.updated','\x7b7d','{}')`)

			dry, err := admin.AdvanceSequences(ctx, env.Pool, env.Schema, consumers.Pool, consumers.Schema, true)
			require.NoError(t, err)
			require.Equal(t, admin.SequenceAdvance{Aggregates: 3, Advanced: 2}, dry)
			res, err := admin.AdvanceSequences(ctx, env.Pool, env.Schema, consumers.Pool, consumers.Schema, false)
			require.NoError(t, err)
			require.Equal(t, admin.SequenceAdvance{Aggregates: 3, Advanced: 2}, res)
			seq := func(id string) int {
				return pgtest.Count(t, env.Pool, `SELECT version FROM `+sqlident.Qualify(env.Schema, "aggregate_sequences")+
					` WHERE aggregate_type = 'order' AND aggregate_id = $1`, id)
			}
			require.Equal(t, 7, seq("a"))
			require.Equal(t, 5, seq("b"))
			require.Equal(t, 10, seq("c"), "sequences never move down")

			p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders"})
			require.NoError(t, err)
			e := relaytest.Event(t, "a", "orders", 1)
			require.NoError(t, p.Publish(ctx, env.Pool, e))
			require.Equal(t, 8, seq("a"), "the next event follows what consumers applied")
		})
	}
}
