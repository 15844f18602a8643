package producer_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
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
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "orders")
	kafkatest.CreateTopic(t, brokers, topic, 1)
	ctx := context.Background()
	cfg := producer.RelayConfig{Schema: env.Schema, Brokers: brokers, PollInterval: 200 * time.Millisecond,
		RebalanceInterval: 250 * time.Millisecond, Logger: testLogger(t)}

	before := publishOrders(t, env, topic, 1, 3, 3)
	_, stop := runRelay(t, env.Pool, cfg)
	requireAllDelivered(t, brokers, topic, ids(before), 30*time.Second)
	stop()
	unsent := publishOrders(t, env, topic, 1, 1, 1)
	moveToAHigherCounterCluster(t, env, 0)

	p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic})
	require.NoError(t, err)
	committed := mustEvent(t, "agg-0", topic, "committed while the re-base ran")
	inFlight := mustEvent(t, "agg-1", topic, "in flight while the re-base ran")
	// This one took its id before the re-base began: the counter, one past
	// the newest completed transaction, may be at or below it.
	early := mustEvent(t, "agg-2", topic, "begun before the re-base, committed while it ran")
	earlyTx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = earlyTx.Rollback(ctx) }()
	require.NoError(t, p.PublishTx(ctx, earlyTx, early))
	var open pgx.Tx
	restore := producer.SetRebaseHook(func(schema string, _ int) {
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
	res, err := producer.RebasePositions(ctx, env.Pool, env.Schema, false)
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

	_, stop = runRelay(t, env.Pool, cfg)
	requireAllDelivered(t, brokers, topic, append(ids(unsent), committed.ID, inFlight.ID, early.ID), 30*time.Second)
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
	exec(`INSERT INTO ` + q("late_events") + ` (consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, previous_version,
			event_type, payload, metadata, kind, reason, current_version)
		VALUES ('billing','e9','order','d',9,8,'order.updated','\x7b7d','{}','passed','passed while parked',10)`)
	dead := func(group, typ, id string, version int64, status string) {
		t.Helper()
		exec(`INSERT INTO `+q("consumer_dead_letters")+` (consumer_group, message_uuid, payload, header_keys, header_values,
				event_id, aggregate_type, aggregate_id, aggregate_version, kind, reason, status)
			VALUES ($1, '\x00', '\x00', '{}', '{}', 'ev', $2, $3, $4, 'permanent', 'test', $5)`, group, typ, id, version, status)
	}
	dead("billing", "order", "a", 12, "dead")         // waits for the operator
	dead("shipping", "order", "e", 15, "discarded")   // given up on, but its version was used
	dead("shipping", "order", "f", 4, "replayed")     // applied or held elsewhere since; counts all the same
	dead("shipping", "", "", 0, "dead")               // did not decode: no version
	dead("shipping", "order", hugeKey(t), 99, "dead") // a hostile record's key

	res, err := producer.AdvanceSequences(ctx, env.Pool, env.Schema, env.Pool, env.Schema, false)
	require.NoError(t, err)
	require.Equal(t, producer.SequenceAdvance{Aggregates: 5, Advanced: 4, KeysTooLong: 1}, res)
	seq := func(id string) int {
		return pgtest.Count(t, env.Pool, `SELECT version FROM `+q("aggregate_sequences")+` WHERE aggregate_type = 'order' AND aggregate_id = $1`, id)
	}
	require.Equal(t, 12, seq("a"), "the dead letter's version, not the applied one below it")
	require.Equal(t, 9, seq("d"), "the late event's version")
	require.Equal(t, 15, seq("e"), "a discarded dead letter's version was used")
	require.Equal(t, 4, seq("f"))

	p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders"})
	require.NoError(t, err)
	require.NoError(t, p.Publish(ctx, env.Pool, mustEvent(t, "a", "orders", 1)))
	require.Equal(t, 13, seq("a"), "the next event follows the version held as a dead letter")
}

// hugeKey returns an aggregate id no PostgreSQL index can hold.
func hugeKey(t *testing.T) string {
	var b [8 << 10]byte
	_, err := rand.Read(b[:])
	require.NoError(t, err)
	return hex.EncodeToString(b[:])
}
