package producer_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/producer"
)

// TestPublishTxTrustsTheCallersVersions: events of an aggregate type in
// Config.CallerVersionedTypes must carry their version, and are written
// with it and nothing else: no aggregate_sequences row. Within a call the
// versions must still follow each other. A call mixing them with
// assigned-version aggregates writes both, and writes nothing when the
// others conflict.
func TestPublishTxTrustsTheCallersVersions(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducerWith(t, env, producer.Config{DefaultTopic: "orders", CallerVersionedTypes: []string{"order"}})
	ctx := context.Background()

	require.NoError(t, p.Publish(ctx, env.Pool, versioned(t, "a", 1)))
	written, err := p.PublishAndCommit(ctx, env.Pool, func(pgx.Tx) ([]eventline.Event, error) {
		return []eventline.Event{versioned(t, "a", 2), versioned(t, "a", 3)}, nil
	})
	require.NoError(t, err)
	require.EqualValues(t, []int64{2, 3}, []int64{written[0].AggregateVersion, written[1].AggregateVersion})
	require.EqualValues(t, []int64{1, 2}, []int64{written[0].PreviousVersion, written[1].PreviousVersion})
	tx := mustTx(t, env)
	written, err = p.PublishTxReturning(ctx, tx, versioned(t, "a", 4))
	require.NoError(t, err)
	require.EqualValues(t, 3, written[0].PreviousVersion)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []int64{1, 2, 3, 4}, versionsOf(t, env, "a"))
	_, _, ok := sequence(t, env, "order", "a")
	require.False(t, ok, "no sequence row for a caller-versioned aggregate")

	// Refused before any SQL: a missing version, a version that does not
	// follow the one before it in the call.
	tx = mustTx(t, env)
	err = p.PublishTx(ctx, tx, orderEvent(t, "b"))
	require.ErrorIs(t, err, eventline.ErrInvalidEvent)
	require.ErrorContains(t, err, "CallerVersionedTypes")
	require.ErrorIs(t, p.PublishTx(ctx, tx, versioned(t, "b", 1), versioned(t, "b", 3)), producer.ErrVersionGap)
	require.ErrorIs(t, p.PublishTx(ctx, tx, versioned(t, "b", 2), versioned(t, "b", 2)), eventline.ErrInvalidEvent)
	requireUsable(t, tx)
	require.NoError(t, tx.Rollback(ctx))

	// Mixed with an assigned-version aggregate: both written, the
	// sequence only for the other one, each event with its version.
	invoice := func(id, topic string) eventline.Event {
		return eventline.Event{Type: "invoice.sent", AggregateType: "invoice", AggregateID: id, Topic: topic, Payload: []byte(`{}`)}
	}
	written, err = p.PublishAndCommit(ctx, env.Pool, func(pgx.Tx) ([]eventline.Event, error) {
		return []eventline.Event{invoice("i", ""), versioned(t, "a", 5), invoice("i", "")}, nil
	})
	require.NoError(t, err)
	require.EqualValues(t, []int64{1, 5, 2}, []int64{written[0].AggregateVersion, written[1].AggregateVersion, written[2].AggregateVersion})
	v, _, ok := sequence(t, env, "invoice", "i")
	require.True(t, ok)
	require.EqualValues(t, 2, v)
	require.Equal(t, []int64{1, 2, 3, 4, 5}, versionsOf(t, env, "a"))

	// When the other aggregate conflicts, nothing of the call is written
	// and the transaction stays usable (PublishTx).
	rows := outboxCount(t, env)
	tx = mustTx(t, env)
	err = p.PublishTx(ctx, tx, versioned(t, "a", 6), invoice("i", "billing"))
	var tc *producer.TopicConflictError
	require.ErrorAs(t, err, &tc)
	require.ErrorContains(t, err, "event 1:")
	requireUsable(t, tx)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, rows, outboxCount(t, env))
}

// TestCallerVersionedRowsAreWhatPublishTxWrites: a caller-versioned
// event's outbox row is byte for byte the row PublishTx writes for the
// same event when it checks the version against the aggregate's sequence.
func TestCallerVersionedRowsAreWhatPublishTxWrites(t *testing.T) {
	t.Parallel()
	envA := pgtest.New(t, pgtest.Options{Shards: 2})
	envB := pgtest.New(t, pgtest.Options{Shards: 2})
	ctx := context.Background()
	trusting := newProducerWith(t, envA, producer.Config{DefaultTopic: "orders", CallerVersionedTypes: []string{"order"}})
	checking := newProducerWith(t, envB, producer.Config{DefaultTopic: "orders"})
	at := time.Date(2024, 2, 29, 23, 59, 58, 123456789, time.UTC)
	calls := [][]eventline.Event{}
	n := 0
	for _, call := range [][][2]any{{{"x", 1}}, {{"x", 2}, {"y", 1}, {"x", 3}}, {{"y", 2}}} {
		var events []eventline.Event
		for _, ev := range call {
			e := versioned(t, ev[0].(string), int64(ev[1].(int)))
			e.ID, e.OccurredAt = "00000000-0000-7000-8000-0000000000"+strconv.Itoa(10+n), at
			e.Metadata = map[string]string{"tenant": "ü <b>&</b>"}
			events = append(events, e)
			n++
		}
		calls = append(calls, events)
	}
	for _, events := range calls {
		require.NoError(t, trusting.Publish(ctx, envA.Pool, events...))
		require.NoError(t, checking.Publish(ctx, envB.Pool, events...))
		for _, e := range events {
			a, b := rowsOf(t, envA, e.ID), rowsOf(t, envB, e.ID)
			require.Len(t, a, 1)
			require.Len(t, b, 1)
			require.Equal(t, b[0].payload, a[0].payload)
			require.Equal(t, b[0].metadata, a[0].metadata)
		}
	}
	require.Equal(t, 0, pgtest.Count(t, envA.Pool, `SELECT count(*) FROM `+envA.Schema+`.aggregate_sequences`))
}
