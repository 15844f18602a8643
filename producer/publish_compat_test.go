package producer_test

import (
	"context"
	"sort"
	"testing"
	"time"

	"github.com/IBM/sarama"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// writeThroughWatermill writes events the way PublishTx did before it
// became one statement: eventline.Encode, then Watermill's forwarder
// publisher over watermill-sql's publisher on the caller's transaction.
// It is the reference for the outbox's on-disk format.
func writeThroughWatermill(t *testing.T, tx pgx.Tx, schema string, shards int, events ...eventline.Event) {
	t.Helper()
	sqlPub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: outbox.SchemaAdapter(schema, 0)}, nil)
	require.NoError(t, err)
	for _, e := range events {
		msg, err := eventline.Encode(e)
		require.NoError(t, err)
		msg.SetContext(context.Background())
		shard := outbox.ShardFor(e.AggregateType, e.AggregateID, shards)
		pub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: outbox.Topic(shard)})
		require.NoError(t, pub.Publish(e.Topic, msg))
	}
}

// outboxRow is one stored outbox row.
type outboxRow struct {
	uuid, payload, metadata string
}

// rowsOf returns the outbox rows whose envelope carries the event id, in
// outbox order.
func rowsOf(t *testing.T, env pgtest.Env, eventID string) []outboxRow {
	t.Helper()
	var out []outboxRow
	for s := 0; s < env.Shards; s++ {
		rows, err := env.Pool.Query(context.Background(), `SELECT uuid, payload::text, metadata::text FROM `+
			sqlident.Qualify(env.Schema, outbox.Table(s))+` WHERE payload->>'uuid' = $1 ORDER BY transaction_id, "offset"`, eventID)
		require.NoError(t, err)
		got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (outboxRow, error) {
			var o outboxRow
			return o, r.Scan(&o.uuid, &o.payload, &o.metadata)
		})
		require.NoError(t, err)
		out = append(out, got...)
	}
	return out
}

// TestPublishTxWritesWatermillsOutboxFormat checks that the one-statement
// write path stores exactly the bytes Watermill's forwarder and
// watermill-sql publishers store for the same event (only the row's own
// uuid and created_at differ), and that the relay turns both into the same
// Kafka record.
func TestPublishTxWritesWatermillsOutboxFormat(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	brokers := kafkatest.Brokers(t)
	topic, other := kafkatest.Topic(t, "orders"), kafkatest.Topic(t, "payments")
	kafkatest.CreateTopic(t, brokers, topic, 2)
	kafkatest.CreateTopic(t, brokers, other, 1)
	ctx := context.Background()
	p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic, AllowVersionGaps: true})
	require.NoError(t, err)

	// Aggregate "gap" is at version 1 before the call.
	require.NoError(t, p.Publish(ctx, env.Pool, orderEvent(t, "gap")))

	at := time.Date(2024, 2, 29, 23, 59, 58, 123456789, time.FixedZone("x", 3600))
	e1 := orderEvent(t, "a")
	e1.CorrelationID = "req-<1>&"
	e1.Metadata = map[string]string{"tenant": "ü <b>&</b>", "z-last": `quote " and \ backslash`}
	e1.OccurredAt = at
	e2 := orderEvent(t, "a")
	e2.SchemaVersion = 3
	e3 := eventline.Event{Type: "payment.captured", AggregateType: "payment", AggregateID: "p-1", AggregateVersion: 1,
		ContentType: "application/octet-stream", Payload: []byte{0, 1, 2, 0xff, '"'}, Topic: other,
		TraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	e4 := orderEvent(t, "gap")
	e4.AggregateVersion = 10
	e5 := orderEvent(t, "gap")
	fresh := orderEvent(t, "fresh")
	fresh.AggregateVersion = 5 // a first event that follows version 0

	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx, e1, e2, e3, e4, e5, fresh)
	require.NoError(t, err)
	require.EqualValues(t, []int64{1, 2, 1, 10, 11, 5}, []int64{written[0].AggregateVersion, written[1].AggregateVersion,
		written[2].AggregateVersion, written[3].AggregateVersion, written[4].AggregateVersion, written[5].AggregateVersion})
	require.EqualValues(t, []int64{0, 1, 0, 1, 10, eventline.NoPreviousVersion}, []int64{written[0].PreviousVersion, written[1].PreviousVersion,
		written[2].PreviousVersion, written[3].PreviousVersion, written[4].PreviousVersion, written[5].PreviousVersion})
	// The reference path, for the same events.
	writeThroughWatermill(t, tx, env.Schema, env.Shards, written...)
	require.NoError(t, tx.Commit(ctx))

	for _, e := range written {
		rows := rowsOf(t, env, e.ID)
		require.Len(t, rows, 2, "event %s: one row from each path", e.ID)
		ours, ref := rows[0], rows[1]
		require.Equal(t, ref.payload, ours.payload, "the forwarder envelope, byte for byte")
		require.Equal(t, ref.metadata, ours.metadata)
		require.Len(t, ours.uuid, 36)
		require.NotEqual(t, ref.uuid, ours.uuid)
	}
	require.Contains(t, rowsOf(t, env, written[5].ID)[0].payload, `"aggregate_previous_version":"0",`, "a first event numbered 5 follows version 0")

	// The relay reads both kinds of row into identical records.
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers})
	type rec struct {
		key, value string
		headers    []string
	}
	got := map[string][]rec{}
	var decoded = map[string]eventline.Event{}
	for _, tp := range []string{topic, other} {
		want := map[string]int{}
		for _, e := range written {
			if e.Topic == tp {
				want[e.ID] = 2
			}
		}
		kafkatest.Consume(t, brokers, tp, 30*time.Second, func(m *sarama.ConsumerMessage) bool {
			r := rec{key: string(m.Key), value: string(m.Value)}
			msg := message.NewMessage("", m.Value)
			for _, h := range m.Headers {
				r.headers = append(r.headers, string(h.Key)+"="+string(h.Value))
				if string(h.Key) == "_watermill_message_uuid" {
					msg.UUID = string(h.Value)
				} else {
					msg.Metadata.Set(string(h.Key), string(h.Value))
				}
			}
			sort.Strings(r.headers)
			e, err := eventline.Decode(msg)
			require.NoError(t, err)
			got[e.ID] = append(got[e.ID], r)
			decoded[e.ID] = e
			for id, n := range want {
				if len(got[id]) < n {
					return false
				}
			}
			return true
		})
	}
	for _, e := range written {
		require.Len(t, got[e.ID], 2)
		require.Equal(t, got[e.ID][1], got[e.ID][0], "event %s: the same record from either row", e.ID)
		d := decoded[e.ID]
		require.Equal(t, e.AggregateVersion, d.AggregateVersion)
		require.Equal(t, e.PreviousVersion, d.PreviousVersion)
		require.Equal(t, e.Payload, d.Payload)
		require.Equal(t, e.Metadata, d.Metadata)
		require.True(t, e.OccurredAt.Equal(d.OccurredAt))
	}
	require.True(t, written[0].OccurredAt.Equal(at))
}
