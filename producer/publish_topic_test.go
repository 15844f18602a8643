package producer_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

func onTopic(e eventline.Event, topic string) eventline.Event {
	e.Topic = topic
	return e
}

// TestPublishTxKeepsAnAggregateOnOneTopic: an aggregate's events all go to
// the topic of its first event; an event for another topic is refused with
// both topics named, nothing written and the transaction usable. Otherwise
// a consumer group reading one topic would wait forever for the versions
// that went to the other.
func TestPublishTxKeepsAnAggregateOnOneTopic(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env) // default topic "orders"
	ctx := context.Background()
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "a")))
	_, topic, _ := sequence(t, env, "order", "a")
	require.Equal(t, "orders", *topic, "recorded with the first event")

	// Each write path: one event; several events of several aggregates;
	// a supplied version.
	for name, events := range map[string][]eventline.Event{
		"one event":        {onTopic(orderEvent(t, "a"), "billing")},
		"several":          {orderEvent(t, "b"), onTopic(orderEvent(t, "a"), "billing"), orderEvent(t, "c")},
		"supplied version": {orderEvent(t, "b"), onTopic(versioned(t, "a", 2), "billing")},
	} {
		tx := mustTx(t, env)
		err := p.PublishTx(ctx, tx, events...)
		require.ErrorIs(t, err, producer.ErrTopicConflict, name)
		var tc *producer.TopicConflictError
		require.ErrorAs(t, err, &tc, name)
		require.Equal(t, producer.TopicConflictError{AggregateType: "order", AggregateID: "a", Topic: "orders", Requested: "billing"}, *tc, name)
		require.ErrorContains(t, err, `"orders"`)
		require.ErrorContains(t, err, `"billing"`)
		requireUsable(t, tx)
		// Nothing of the call was written: the other aggregates' versions
		// start at 1, a's goes on at 2.
		written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), orderEvent(t, "b"))
		require.NoError(t, err, name)
		require.EqualValues(t, []int64{2, 1}, []int64{written[0].AggregateVersion, written[1].AggregateVersion}, name)
		require.NoError(t, tx.Rollback(ctx))
		_, _, ok := sequence(t, env, "order", "b")
		require.False(t, ok, name)
	}

	// Two topics for one aggregate in one call: refused before any SQL.
	err := p.PublishTx(ctx, closedTx(t, env), orderEvent(t, "n"), onTopic(orderEvent(t, "n"), "billing"))
	var tc *producer.TopicConflictError
	require.ErrorAs(t, err, &tc)
	require.Equal(t, producer.TopicConflictError{AggregateType: "order", AggregateID: "n", Topic: "orders", Requested: "billing"}, *tc)

	// Another aggregate type with the same id is another aggregate.
	require.NoError(t, p.Publish(ctx, env.Pool, eventline.Event{Type: "invoice.sent", AggregateType: "invoice", AggregateID: "a", Topic: "billing", Payload: []byte(`{}`)}))
	require.Equal(t, 0, outboxRowsFor(t, env, "billing", "order"))
}

// TestPublishTxRecordsTheTopicOfOlderAggregates: aggregates whose sequence
// row predates topics (NULL) get their topic recorded by their next
// publish, whichever write path it takes.
func TestPublishTxRecordsTheTopicOfOlderAggregates(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx := context.Background()
	_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "aggregate_sequences")+
		` (aggregate_type, aggregate_id, version) VALUES ('order', 'one', 4), ('order', 'many', 7), ('order', 'sup', 2)`)
	require.NoError(t, err)

	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "one"))
	require.NoError(t, err)
	require.EqualValues(t, 5, written[0].AggregateVersion)
	require.NoError(t, tx.Rollback(ctx)) // and the topic with it
	_, topic, _ := sequence(t, env, "order", "one")
	require.Nil(t, topic)
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "one")))
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "many"), orderEvent(t, "x"), orderEvent(t, "many")))
	require.NoError(t, p.Publish(ctx, env.Pool, versioned(t, "sup", 3)))
	for id, want := range map[string]int64{"one": 5, "many": 9, "sup": 3, "x": 1} {
		v, topic, ok := sequence(t, env, "order", id)
		require.True(t, ok, id)
		require.Equal(t, want, v, id)
		require.NotNil(t, topic, id)
		require.Equal(t, "orders", *topic, id)
	}
	require.Equal(t, []int64{8, 9}, versionsOf(t, env, "many"))
	require.ErrorIs(t, p.Publish(ctx, env.Pool, onTopic(orderEvent(t, "one"), "billing")), producer.ErrTopicConflict)
}

func outboxRowsFor(t *testing.T, env pgtest.Env, topic, aggregateType string) int {
	t.Helper()
	n := 0
	for s := 0; s < env.Shards; s++ {
		n += pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, outbox.Table(s))+
			` WHERE payload->>'destination_topic' = $1 AND payload->'metadata'->>'aggregate_type' = $2`, topic, aggregateType)
	}
	return n
}
