package producer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/producer"
)

func TestRelayForwardsEveryEventKeyedByAggregate(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 4, MaxConns: 10}, 6)

	events := relaytest.PublishOrders(t, env, topic, 20, 500, 10)
	_, stop := relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, BatchSize: 64})

	records := relaytest.ReadTopic(t, brokers, topic, len(events), 30*time.Second)
	counts := relaytest.Distinct(records)
	require.Len(t, counts, len(events), "every committed event reaches Kafka")
	for _, e := range events {
		require.Equal(t, 1, counts[e.ID], "event %s forwarded exactly once without crashes", e.ID)
	}

	// Keyed by aggregate id: one aggregate, one partition, versions in order.
	partitionOf := map[string]int32{}
	lastVersion := map[string]int64{}
	for _, r := range records {
		if p, ok := partitionOf[r.Key]; ok {
			require.Equal(t, p, r.Partition, "aggregate %s split over partitions", r.Key)
		}
		partitionOf[r.Key] = r.Partition
		require.Greater(t, r.Version, lastVersion[r.Key], "aggregate %s out of order", r.Key)
		lastVersion[r.Key] = r.Version
	}

	stop()
	st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
	require.NoError(t, err)
	require.Zero(t, st.Backlog(), "relay recorded its progress: %+v", st)
	require.Zero(t, st.DeadLetters)
}

// TestRelayPartitionsLikeKafkasJavaClient: each aggregate's events land in
// the partition any other Kafka producer of the same key would pick (the
// Java client's default partitioner, Kafka Streams, franz-go: murmur2), so
// a backfill or a connector writing the same keys keeps per-aggregate
// order. Before, the relay used Sarama's FNV-1a hash and most keys landed
// elsewhere.
func TestRelayPartitionsLikeKafkasJavaClient(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "orders")
	const partitions = 6
	kafkatest.CreateTopic(t, brokers, topic, partitions)
	events := relaytest.PublishOrders(t, env, topic, 50, 50, 10) // 50 aggregates, one event each
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers})

	java := kgo.StickyKeyPartitioner(nil).ForTopic(topic)
	moved := 0
	for _, r := range relaytest.ReadTopic(t, brokers, topic, len(events), 30*time.Second) {
		if want := java.Partition(&kgo.Record{Key: []byte(r.Key)}, partitions); int32(want) != r.Partition {
			moved++
			t.Logf("key %s: partition %d, a Java client would use %d", r.Key, r.Partition, want)
		}
	}
	require.Zero(t, moved, "%d of %d keys in a different partition than Kafka's default partitioner picks", moved, len(events))
}

func TestNewRelayValidatesConfig(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	_, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{
		Schema: env.Schema, Brokers: []string{"nohostport"}, BatchSize: -1, Backoff: eventline.Backoff{Initial: -time.Second},
	})
	require.Error(t, err)
	for _, field := range []string{"RelayConfig.Brokers", "RelayConfig.BatchSize", "RelayConfig.Backoff"} {
		require.ErrorContains(t, err, field)
	}
	_, err = producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{Schema: "missing_schema", Brokers: []string{"localhost:9092"}})
	require.ErrorIs(t, err, producer.ErrNotMigrated)
}

func ExampleRelay() {
	// A relay process: run until SIGTERM, sharing the outbox's shards with
	// any other relay processes pointed at the same database.
	run := func(ctx context.Context, env pgtest.Env) error {
		relay, err := producer.NewRelay(ctx, env.Pool, producer.RelayConfig{
			Schema:  env.Schema,
			Brokers: []string{"localhost:9092"},
		})
		if err != nil {
			return err
		}
		return relay.Run(ctx) // returns nil after ctx ends and in-flight batches settle
	}
	fmt.Println(run != nil)
	// Output: true
}
