package producer_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/producer"
)

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

// TestPublishTxRefusesOversizeEventBeforeSQL: an event whose Kafka record
// would exceed MaxMessageBytes is refused before any SQL (here, in a
// transaction that has already ended, any statement would fail), with the
// size and the limit.
func TestPublishTxRefusesOversizeEventBeforeSQL(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx := context.Background()

	big := orderEvent(t, "a")
	big.Payload = []byte(`"` + strings.Repeat("x", 2<<20) + `"`) // 2 MiB of JSON
	err := p.PublishTx(ctx, closedTx(t, env), orderEvent(t, "b"), big)
	require.ErrorIs(t, err, producer.ErrEventTooLarge)
	var tooLarge *producer.EventTooLargeError
	require.ErrorAs(t, err, &tooLarge)
	require.Equal(t, 1, tooLarge.Index)
	require.Equal(t, producer.DefaultMaxMessageBytes, tooLarge.Limit)
	require.Greater(t, tooLarge.Size, 2<<20)
	require.ErrorContains(t, err, "MaxMessageBytes")

	tx := mustTx(t, env)
	require.ErrorIs(t, p.PublishTx(ctx, tx, orderEvent(t, "b"), big), producer.ErrEventTooLarge)
	requireUsable(t, tx)
	require.NoError(t, tx.Commit(ctx))
	require.Zero(t, outboxCount(t, env))
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

// TestPublishTxRefusesUnstorableMetadataBeforeSQL: NUL bytes and invalid
// UTF-8 in metadata keys or values can neither be stored byte-exact by
// consumers nor travel as they are; they are refused before any SQL.
func TestPublishTxRefusesUnstorableMetadataBeforeSQL(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	for name, md := range map[string]map[string]string{
		"NUL in value":        {"tenant": "a\x00b"},
		"NUL in key":          {"ten\x00ant": "acme"},
		"invalid UTF-8 value": {"tenant": "a\xffb"},
		"invalid UTF-8 key":   {"ten\xc3ant": "acme"},
		"reserved key":        {"traceparent": "00-x"},
	} {
		e := orderEvent(t, "a")
		e.Metadata = md
		err := p.PublishTx(context.Background(), closedTx(t, env), e)
		require.ErrorIs(t, err, eventline.ErrInvalidEvent, name)
		var ie *eventline.InvalidEventError
		require.ErrorAs(t, err, &ie, name)
		require.Equal(t, "metadata", ie.Field, name)
	}
	// NUL in the envelope's own text fields too.
	e := orderEvent(t, "a")
	e.CorrelationID = "x\x00"
	require.ErrorIs(t, p.PublishTx(context.Background(), closedTx(t, env), e), eventline.ErrInvalidEvent)
}

func TestNewValidatesLimitsAndSchemaVersions(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	for field, cfg := range map[string]producer.Config{
		"producer.Config.MaxMessageBytes": {MaxMessageBytes: -1},
		"producer.Config.SchemaVersions":  {SchemaVersions: map[string]int{"order.created": 0}},
	} {
		cfg.Schema = env.Schema
		_, err := producer.New(context.Background(), env.Pool, cfg)
		require.ErrorContains(t, err, field)
	}
	_, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, MaxMessageBytes: 200 << 20})
	require.ErrorContains(t, err, "producer.Config.MaxMessageBytes")
}
