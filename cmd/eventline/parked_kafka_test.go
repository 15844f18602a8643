package main

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// TestParkedListFindsTheMissingVersionOnKafka: with -brokers, a missing
// version the relay published is found on Kafka (partition, offset) with
// the group's committed offset there: not reached yet, then past it.
// Before: only "relayed", nothing about Kafka.
func TestParkedListFindsTheMissingVersionOnKafka(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "things")
	kafkatest.CreateTopic(t, brokers, topic, 2)

	// thing/k v1..v3 committed and relayed; the group applied v1 and
	// parked v3; v2 is on Kafka.
	p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic})
	require.NoError(t, err)
	var events []eventline.Event
	for _, id := range []string{"k", "gone"} { // gone's events never reach Kafka
		for i := 0; i < 3; i++ {
			e, err := eventline.NewJSONEvent("thing.changed", "thing", id, map[string]int{"n": i})
			require.NoError(t, err)
			events = append(events, e)
		}
	}
	require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		events, err = p.PublishTxReturning(ctx, tx, events...)
		return err
	}))
	_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, outbox.OffsetsTable(0))+
		` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ($1, 1000000, pg_snapshot_xmax(pg_current_snapshot()))`, outbox.RelayConsumerGroup)
	require.NoError(t, err)
	parkGap(t, env, "billing", "k", 1, 3)
	parkGap(t, env, "billing", "gone", 1, 3)

	cfg := kafkaconf.Producer("parked-test")
	cfg.Producer.Idempotent = false
	cfg.Net.MaxOpenRequests = 5
	sp, err := sarama.NewSyncProducer(brokers, cfg)
	require.NoError(t, err)
	m := kafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
		return msg.Metadata.Get(eventline.MetaAggregateID), nil
	})
	var part int32
	var offset int64
	for _, e := range events[:3] {
		msg, err := eventline.Encode(e)
		require.NoError(t, err)
		pm, err := m.Marshal(topic, msg)
		require.NoError(t, err)
		pt, off, err := sp.SendMessage(pm)
		require.NoError(t, err)
		if e.AggregateVersion == 2 {
			part, offset = pt, off
		}
	}
	require.NoError(t, sp.Close())

	type entry struct {
		WaitingFor struct {
			Location string `json:"location"`
			Detail   string `json:"detail"`
			Kafka    *struct {
				Topic          string `json:"topic"`
				Partition      int32  `json:"partition"`
				Offset         int64  `json:"offset"`
				GroupCommitted *int64 `json:"group_committed_offset"`
			} `json:"kafka"`
		} `json:"waiting_for"`
	}
	brokerArgs := []string{"-brokers", brokers[0]}
	list := okJSON[[]entry](t, env.Schema, append([]string{"parked", "list", "-json"}, brokerArgs...)...)
	require.Len(t, list, 2)
	gone := list[0].WaitingFor // listed by aggregate id
	require.Equal(t, "relayed", gone.Location)
	require.Contains(t, gone.Detail, "but not found there from its commit time on")
	w := list[1].WaitingFor
	require.Equal(t, "kafka", w.Location, w.Detail)
	require.NotNil(t, w.Kafka)
	require.Equal(t, []any{topic, part, offset}, []any{w.Kafka.Topic, w.Kafka.Partition, w.Kafka.Offset})
	require.Nil(t, w.Kafka.GroupCommitted)
	require.Contains(t, w.Detail, "the group has committed no offset there")

	commitEnd(t, brokers, "billing", topic, part)
	out := ok(t, env.Schema, append([]string{"parked", "list"}, brokerArgs...)...)
	require.Contains(t, out, "version 2: kafka: on Kafka at "+topic)
	require.Contains(t, out, "past it, yet it was not applied")
	require.Contains(t, ok(t, env.Schema, "parked", "list"), "version 2: relayed: relayed to Kafka topic", "without -brokers Kafka is not read")
}

// commitEnd commits the group's offset at the end of one partition (a bare
// OffsetCommit, as a group without members commits) and waits until it is
// visible.
func commitEnd(t *testing.T, brokers []string, group, topic string, part int32) {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	client, err := sarama.NewClient(brokers, cfg)
	require.NoError(t, err)
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	require.NoError(t, err)
	high, err := client.GetOffset(topic, part, sarama.OffsetNewest)
	require.NoError(t, err)
	coord, err := client.Coordinator(group)
	require.NoError(t, err)
	req := &sarama.OffsetCommitRequest{Version: 2, ConsumerGroup: group, ConsumerGroupGeneration: -1, RetentionTime: -1}
	req.AddBlock(topic, part, high, 0, "")
	resp, err := coord.CommitOffset(req)
	require.NoError(t, err)
	for _, errs := range resp.Errors {
		for _, kerr := range errs {
			require.Equal(t, sarama.ErrNoError, kerr)
		}
	}
	require.Eventually(t, func() bool {
		resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: {part}})
		b := resp.GetBlock(topic, part)
		return err == nil && b != nil && b.Offset == high
	}, 10*time.Second, 20*time.Millisecond)
}
