package e2e_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/kafkabroker"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/producer"
)

// TestJavaClientAgreesOnPartitions: for 3000 keys (aggregate ids of many
// shapes and lengths, some not ASCII), Apache Kafka's Java producer with
// its default partitioner (internal/kafkabroker/java/PartitionProbe.java,
// against kafka-clients 4.4) and eventline's relay (its default
// partitioner) put each key's record in the same partition of a
// 12-partition topic, as the brokers report them. Another producer of the
// same aggregates, or Kafka Streams, thus agrees with eventline on where
// each aggregate lives.
func TestJavaClientAgreesOnPartitions(t *testing.T) {
	kafkatest.NeedReal(t)
	t.Parallel()
	ctx := context.Background()
	const partitions = 12
	k := kafkatest.Start(t, kafkatest.Config{})
	javaTopic, relayTopic := kafkatest.Topic(t, "java-partitions"), kafkatest.Topic(t, "relay-partitions")
	require.NoError(t, k.CreateTopics(ctx, partitions, javaTopic, relayTopic))

	prng := rand.New(rand.NewPCG(17, 42))
	keys := make([]string, 0, 3000)
	seen := map[string]bool{}
	for len(keys) < cap(keys) {
		var key string
		switch len(keys) % 5 {
		case 0:
			key = uuid.NewString()
		case 1:
			key = fmt.Sprintf("order-%d", prng.IntN(1_000_000))
		case 2:
			key = fmt.Sprint(prng.Int64())
		case 3:
			key = fmt.Sprintf("客户-%d-ü", prng.IntN(100_000))
		default:
			b := make([]byte, 1+prng.IntN(40))
			for i := range b {
				b[i] = byte('a' + prng.IntN(26))
			}
			key = string(b)
		}
		if !seen[key] {
			seen[key] = true
			keys = append(keys, key)
		}
	}

	begin := time.Now()
	java, err := kafkabroker.RunPartitionProbe(ctx, k.Brokers, javaTopic, keys)
	require.NoError(t, err)
	t.Logf("the Java producer wrote %d keys in %s (javac and JVM start included)", len(java), time.Since(begin).Round(time.Millisecond))
	recs, err := kafkatest.ReadTopic(ctx, k.Brokers, javaTopic)
	require.NoError(t, err)
	require.Len(t, recs, len(keys))
	for _, r := range recs {
		require.Equal(t, java[r.Key].Partition, r.Partition, "key %q: where the broker holds the Java producer's record", r.Key)
	}

	env := pgtest.New(t, pgtest.Options{Shards: 4, MaxConns: 12})
	prod, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: relayTopic})
	require.NoError(t, err)
	for i := 0; i < len(keys); i += 500 {
		var evs []eventline.Event
		for _, key := range keys[i:min(i+500, len(keys))] {
			e, err := eventline.NewJSONEvent("order.created", "order", key, map[string]string{"id": key})
			require.NoError(t, err)
			evs = append(evs, e)
		}
		require.NoError(t, prod.Publish(ctx, env.Pool, evs...))
	}
	rel, err := producer.NewRelay(ctx, env.Pool, producer.RelayConfig{Schema: env.Schema, Brokers: k.Brokers, PollInterval: 100 * time.Millisecond, Logger: testLogger()})
	require.NoError(t, err)
	stop := runUntilStopped(t, rel.Run)
	require.Eventually(t, func() bool {
		st, err := admin.ReadOutboxStatus(ctx, env.Pool, env.Schema)
		require.NoError(t, err)
		return st.Backlog() == 0
	}, 2*time.Minute, 50*time.Millisecond, "the relay publishes every event")
	stop()
	recs, err = kafkatest.ReadTopic(ctx, k.Brokers, relayTopic)
	require.NoError(t, err)
	relay := map[string]int32{}
	for _, r := range recs {
		relay[r.Key] = r.Partition
	}
	require.Len(t, relay, len(keys))
	counts := make([]int, partitions)
	for _, key := range keys {
		require.Equal(t, java[key].Partition, relay[key], "key %q: the Java producer's partition and eventline's relay's", key)
		counts[relay[key]]++
	}
	t.Logf("%d keys on the same partitions from both producers; per partition: %v", len(keys), counts)
}
