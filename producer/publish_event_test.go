package producer_test

import (
	"context"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
	"github.com/eventline/eventline/producer"
)

// TestPublishTxStampsDeclaredSchemaVersion: events of a declared type get
// the declared payload schema version unless they carry one; a version
// above the declared one is refused before any SQL.
func TestPublishTxStampsDeclaredSchemaVersion(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	declared := map[string]int{"order.created": 3}
	p := newProducerWith(t, env, producer.Config{SchemaVersions: declared})
	declared["order.created"] = 9 // the producer keeps its own copy
	ctx := context.Background()

	older := orderEvent(t, "a")
	older.SchemaVersion = 2
	other := eventline.Event{Type: "order.noted", AggregateType: "order", AggregateID: "a", Payload: []byte(`{}`)}
	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), older, other)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []int{3, 2, 1}, []int{written[0].SchemaVersion, written[1].SchemaVersion, written[2].SchemaVersion})
	for i, want := range []int{3, 2, 1} {
		stored, md := storedEvent(t, env, written[i].ID)
		require.Equal(t, want, stored.SchemaVersion)
		require.Equal(t, []string{"3", "2", "1"}[i], md[eventline.MetaEventVersion])
	}

	newer := orderEvent(t, "a")
	newer.SchemaVersion = 4
	err = p.PublishTx(ctx, closedTx(t, env), orderEvent(t, "a"), newer)
	require.ErrorIs(t, err, producer.ErrSchemaVersion)
	var sv *producer.SchemaVersionError
	require.ErrorAs(t, err, &sv)
	require.Equal(t, producer.SchemaVersionError{Index: 1, EventType: "order.created", Version: 4, Declared: 3}, *sv)
}

var w3c = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// TestPublishTxCapturesTheCallersTraceContext: the span and baggage in
// PublishTx's context are written into the stored row (W3C traceparent,
// tracestate and baggage), where the relay and the consumers find them.
func TestPublishTxCapturesTheCallersTraceContext(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducerWith(t, env, producer.Config{Propagator: w3c})

	ts, err := trace.ParseTraceState("vendor=abc")
	require.NoError(t, err)
	parent := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5}, TraceFlags: trace.FlagsSampled, TraceState: ts, Remote: true,
	})
	ctx := trace.ContextWithRemoteSpanContext(context.Background(), parent)
	member, err := baggage.NewMember("tenant", "acme")
	require.NoError(t, err)
	bag, err := baggage.New(member)
	require.NoError(t, err)
	ctx = baggage.ContextWithBaggage(ctx, bag)
	ctx, span := tracingtest.New(t).Provider.Tracer("eventline-test").Start(ctx, "place order")
	defer span.End()
	sc := span.SpanContext()
	wantParent := "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"

	own := orderEvent(t, "b")
	own.TraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	keeps := orderEvent(t, "c")
	keeps.Metadata = map[string]string{"baggage": "mine=1"}
	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), own, keeps, orderEvent(t, "d"))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.NotContains(t, keeps.Metadata, "tracestate", "the caller's metadata map is not modified")

	stored, md := storedEvent(t, env, written[0].ID)
	require.Equal(t, wantParent, stored.TraceParent)
	require.Equal(t, wantParent, md[eventline.MetaTraceParent])
	require.Equal(t, "tenant=acme", md["baggage"])
	require.Equal(t, "vendor=abc", md["tracestate"])
	require.Equal(t, map[string]string{"baggage": "tenant=acme", "tracestate": "vendor=abc"}, stored.Metadata)
	require.Equal(t, written[0].TraceParent, stored.TraceParent, "PublishTxReturning shows it")

	stored, md = storedEvent(t, env, written[1].ID)
	require.Equal(t, own.TraceParent, stored.TraceParent, "an event with its own trace context keeps it")
	require.NotContains(t, md, "baggage")

	stored, _ = storedEvent(t, env, written[2].ID)
	require.Equal(t, wantParent, stored.TraceParent)
	require.Equal(t, "mine=1", stored.Metadata["baggage"], "metadata the caller set wins")

	// The multi-event and the one-event write paths both carry it.
	written, err = p.PublishTxReturning(ctx, mustTx(t, env), orderEvent(t, "e"))
	require.NoError(t, err)
	require.Equal(t, wantParent, written[0].TraceParent)
}

// TestPublishTxWithoutSpanAddsNothing: no span, no baggage: the event is
// stored without trace headers (and the propagator is never called).
func TestPublishTxWithoutSpanAddsNothing(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducerWith(t, env, producer.Config{Propagator: panickingPropagator{}})
	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(context.Background(), tx, orderEvent(t, "a"))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(context.Background()))
	stored, md := storedEvent(t, env, written[0].ID)
	require.Empty(t, stored.TraceParent)
	require.NotContains(t, md, eventline.MetaTraceParent)
	require.NotContains(t, md, "baggage")
}

type panickingPropagator struct{ propagation.TextMapPropagator }

func (panickingPropagator) Inject(context.Context, propagation.TextMapCarrier) {
	panic("the propagator must not be called without a span or baggage")
}

// TestPublishTxUsesTheGlobalPropagatorByDefault (not parallel: it sets
// OpenTelemetry's global propagator).
func TestPublishTxUsesTheGlobalPropagatorByDefault(t *testing.T) {
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx, span := tracingtest.New(t).Provider.Tracer("eventline-test").Start(context.Background(), "work")
	defer span.End()

	// OpenTelemetry's own default propagates nothing. Once a process set a
	// global propagator it cannot be unset (restoring the previous one
	// keeps the delegate), so with -count>1 the global writes headers by
	// now: PublishTx must then write just what the global writes.
	carrier := propagation.MapCarrier{}
	otel.GetTextMapPropagator().Inject(ctx, carrier)
	written, err := p.PublishTxReturning(ctx, mustTx(t, env), orderEvent(t, "a"))
	require.NoError(t, err)
	require.Equal(t, carrier.Get("traceparent"), written[0].TraceParent)

	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(w3c)
	t.Cleanup(func() { otel.SetTextMapPropagator(prev) })
	written, err = p.PublishTxReturning(ctx, mustTx(t, env), orderEvent(t, "b"))
	require.NoError(t, err)
	require.Contains(t, written[0].TraceParent, span.SpanContext().TraceID().String())
}

// kafkaRecord builds the Kafka record the relay builds from an event
// message: watermill-kafka's marshaler, keyed by aggregate id.
func kafkaRecord(t *testing.T, topic string, msg *message.Message) *sarama.ProducerMessage {
	t.Helper()
	m := kafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
		return msg.Metadata.Get(eventline.MetaAggregateID), nil
	})
	pm, err := m.Marshal(topic, msg)
	require.NoError(t, err)
	return pm
}

func TestEncodedRecordSizeIsSaramasByteSize(t *testing.T) {
	t.Parallel()
	for name, e := range map[string]eventline.Event{
		"small": {Type: "t", AggregateType: "a", AggregateID: "1", AggregateVersion: 1, Payload: []byte(`{}`)},
		"full": {ID: "evt", Type: "order.created", SchemaVersion: 3, AggregateType: "order", AggregateID: "ünïcode-42",
			AggregateVersion: 12345, PreviousVersion: 7, CorrelationID: "c", TraceParent: "00-x-y-01",
			ContentType: "text/plain", Payload: []byte(strings.Repeat("x", 5000)), Metadata: map[string]string{"tenant": "acme", "baggage": "k=v"}},
	} {
		msg, err := eventline.Encode(e)
		require.NoError(t, err, name)
		require.Equal(t, kafkaRecord(t, "orders", msg).ByteSize(2), producer.EncodedRecordSize(msg), name)
	}
	require.Zero(t, producer.EncodedRecordSize(nil))
}

// TestMaxMessageBytesMatchesWhatSaramaSends: the producer accepts an event
// exactly when a Sarama producer with the same MaxMessageBytes sends its
// record (for a supplied version, whose size is known exactly; an assigned
// version is counted at its largest).
func TestMaxMessageBytesMatchesWhatSaramaSends(t *testing.T) {
	t.Parallel()
	const limit = 20_000
	env := pgtest.New(t, pgtest.Options{})
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "sized")
	kafkatest.CreateTopic(t, brokers, topic, 1)
	p := newProducerWith(t, env, producer.Config{DefaultTopic: topic, MaxMessageBytes: limit})
	ctx := context.Background()

	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.Producer.Return.Successes = true
	cfg.Producer.MaxMessageBytes = limit
	sp, err := sarama.NewSyncProducer(brokers, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sp.Close() })

	// sized returns an event of aggregate id whose record is exactly size
	// bytes at version 1.
	sized := func(id string, size int) eventline.Event {
		e := versioned(t, id, 1)
		e.ID = eventline.NewEventID()
		e.OccurredAt = time.Now()
		e.Payload = []byte(`""`)
		msg, err := eventline.Encode(e)
		require.NoError(t, err)
		e.Payload = []byte(`"` + strings.Repeat("x", size-producer.EncodedRecordSize(msg)) + `"`)
		msg, err = eventline.Encode(e)
		require.NoError(t, err)
		require.Equal(t, size, producer.EncodedRecordSize(msg))
		return e
	}
	send := func(e eventline.Event) error {
		msg, err := eventline.Encode(e)
		require.NoError(t, err)
		_, _, err = sp.SendMessage(kafkaRecord(t, topic, msg))
		return err
	}

	fits := sized("fits", limit)
	written, err := p.PublishTxReturning(ctx, mustTx(t, env), fits)
	require.NoError(t, err)
	require.NoError(t, send(written[0]), "Sarama sends what the producer accepted")

	over := sized("over", limit+1)
	require.ErrorIs(t, p.PublishTx(ctx, mustTx(t, env), over), producer.ErrEventTooLarge)
	err = send(over)
	var cfgErr sarama.ConfigurationError
	require.ErrorAs(t, err, &cfgErr, "Sarama refuses what the producer refused: %v", err)

	// Without a supplied version, room is kept for the largest version.
	auto := sized("auto", limit-17) // 19 digits where version 1 has one
	auto.AggregateVersion = 0
	require.ErrorIs(t, p.PublishTx(ctx, mustTx(t, env), auto), producer.ErrEventTooLarge)
	auto = sized("auto", limit-18)
	auto.AggregateVersion = 0
	require.NoError(t, p.PublishTx(ctx, mustTx(t, env), auto))
}

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
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2}, 2)
	other := kafkatest.Topic(t, "payments")
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
