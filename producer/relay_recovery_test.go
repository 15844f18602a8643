package producer_test

import (
	"context"
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
// position on it, so the relay never sent it. A producer still in flight
// while the rows are moved commits after the re-base. Both events must be
// relayed, with the old cluster's unsent one.
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
	var open pgx.Tx
	restore := producer.SetRebaseHook(func(schema string, _ int) {
		if schema != env.Schema {
			return
		}
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

	// Both rows sort after the new position.
	var rows, behind int
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE
			(m.transaction_id, m."offset") <= (o.last_processed_transaction_id, o.offset_acked)) FROM `+sqlident.Qualify(env.Schema, outbox.Table(0))+` m, `+
		sqlident.Qualify(env.Schema, outbox.OffsetsTable(0))+` o
		WHERE o.consumer_group = $1 AND m.payload->>'uuid' = ANY($2)`, outbox.RelayConsumerGroup, []string{committed.ID, inFlight.ID}).Scan(&rows, &behind))
	require.Equal(t, 2, rows)
	require.Zero(t, behind, "an event committed during the re-base is at or before the relay's position: it will never be sent")
	require.True(t, res[0].Ahead())
	require.EqualValues(t, 3, res[0].Relayed, "only the rows relayed on the old cluster count as relayed")
	require.EqualValues(t, 1, res[0].Pending)

	_, stop = runRelay(t, env.Pool, cfg)
	requireAllDelivered(t, brokers, topic, append(ids(unsent), committed.ID, inFlight.ID), 30*time.Second)
	stop()
}
