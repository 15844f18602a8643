package verify_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin/verify"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
)

// A pipeline run by the real producer, relay and consumer, with Kafka
// redeliveries and an aggregate whose versions reach Kafka out of order
// (so the gate parks, then drains), keeps every guarantee: verify reports
// nothing.
func TestCleanPipelineReportsNothing(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 2)
	f.withKafka(3)
	ctx := context.Background()
	gname := kafkatest.Topic(t, "billing")
	f.createEffects()

	// DESIGN.md's ordering caveat, on purpose: transaction A takes its xid
	// first and locks the aggregate last, so its version 2 precedes B's
	// version 1 in the outbox and on Kafka.
	txA, err := f.env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer txA.Rollback(ctx)
	_, err = txA.Exec(ctx, `SELECT pg_current_xact_id()`)
	require.NoError(t, err)
	f.publish("inverted", 1)
	e, err := eventline.NewJSONEvent("order.updated", "order", "inverted", map[string]int{"n": 2})
	require.NoError(t, err)
	require.NoError(t, f.prod.PublishTx(ctx, txA, e))
	require.NoError(t, txA.Commit(ctx))
	var events []eventline.Event
	for _, id := range []string{"a", "b", "c", "d"} {
		events = append(events, f.publish(id, 3)...)
	}

	relay, err := producer.NewRelay(ctx, f.env.Pool, producer.RelayConfig{
		Schema: f.env.Schema, Brokers: f.brokers, PollInterval: 200 * time.Millisecond, RebalanceInterval: 100 * time.Millisecond,
	})
	require.NoError(t, err)
	stopRelay := relaytest.Background(t, relay.Run)
	c, err := consumer.New(f.env.Pool, consumer.Config{
		Config: middleware.Config{
			Group:         gname,
			Schema:        f.env.Schema,
			SweepInterval: 100 * time.Millisecond,
		},
		Brokers: f.brokers,
		Topics:  []string{f.topic},
	})
	require.NoError(t, err)
	effects := sqlident.Qualify(f.env.Schema, "effects")
	require.NoError(t, c.Handle("order.updated", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+effects+` (event_id) VALUES ($1)`, e.ID)
		return err
	}))
	stopConsumer := relaytest.Background(t, c.Run)

	const total = 14
	applied := func() int {
		return pgtest.Count(t, f.env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(f.env.Schema, "processed_events")+
			` WHERE consumer_group = $1 AND outcome = 'applied'`, gname)
	}
	require.Eventually(t, func() bool { return applied() == total }, time.Minute, 20*time.Millisecond)
	// Kafka gets a second copy of some records, as after a relay crash
	// between Kafka's ack and the position write: the group skips them.
	f.produce(f.topic, events[:4], nil)
	require.Eventually(t, func() bool {
		return pgtest.Count(t, f.env.Pool, `SELECT count(*) FROM `+effects) == total && f.committedToEnd(gname, f.topic)
	}, time.Minute, 50*time.Millisecond)
	stopConsumer()
	stopRelay()

	rep := f.run(verify.Config{EffectsQueries: map[string]string{gname: f.effectsQuery()}})
	require.True(t, rep.OK)
	require.Empty(t, rep.Findings)
	require.Empty(t, rep.Omitted)
	require.Zero(t, rep.Problems)
	require.Zero(t, rep.Warnings)
	require.EqualValues(t, total, rep.Outbox.Events)
	require.EqualValues(t, total, rep.Outbox.Relayed)
	g := group(t, rep, gname)
	require.Equal(t, "kafka", g.TopicsFrom)
	require.EqualValues(t, total, g.Events)
	require.Equal(t, map[string]int64{"applied": total}, g.Outcomes)
	require.NotNil(t, g.AppliedTwice)
	require.Zero(t, *g.AppliedTwice)
	require.Len(t, rep.Kafka.Topics, 1)
	require.EqualValues(t, total+4, rep.Kafka.Topics[0].Records)
	require.EqualValues(t, 4, rep.Kafka.Topics[0].Duplicates)

	// Without the effects query, the order is read from processed_events:
	// the inverted aggregate, parked and then drained, is not reported.
	rep = f.run(verify.Config{})
	require.True(t, rep.OK)
	require.Empty(t, rep.Findings)
}
