package kafkatest_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/eventlinetest/kafkatest"
	internalkafka "github.com/eventline/eventline/internal/kafkatest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Sarama's metrics registry starts a process-wide meter ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

func TestStartCreatesTopicsAndPublishKeysByAggregate(t *testing.T) {
	t.Setenv(kafkatest.BrokersEnv, "")
	k := kafkatest.Start(t, "orders")
	require.True(t, k.InProcess())
	require.Len(t, k.Brokers, 1)

	var events []eventline.Event
	for v := int64(1); v <= 3; v++ {
		for _, id := range []string{"o-1", "o-2", "o-3"} {
			e, err := eventline.NewJSONEvent("order.changed", "order", id, map[string]int64{"v": v})
			require.NoError(t, err)
			e.AggregateVersion = v
			events = append(events, e)
		}
	}
	require.NoError(t, kafkatest.Publish(context.Background(), k.Brokers, "orders", events...))

	got, err := internalkafka.ReadTopic(context.Background(), k.Brokers, "orders")
	require.NoError(t, err)
	require.Len(t, got, len(events))
	partition := map[string]int32{}
	versions := map[string][]string{}
	for _, r := range got {
		if p, ok := partition[r.Key]; ok {
			require.Equal(t, p, r.Partition, "one aggregate, one partition")
		}
		partition[r.Key] = r.Partition
		versions[r.Key] = append(versions[r.Key], r.Version)
	}
	for _, id := range []string{"o-1", "o-2", "o-3"} {
		require.Equal(t, []string{"1", "2", "3"}, versions[id], "an aggregate's records keep their order")
	}
}

func TestStartRefusesUnknownTopicsUnlessAsked(t *testing.T) {
	t.Setenv(kafkatest.BrokersEnv, "")
	k := kafkatest.Start(t)
	e, err := eventline.NewJSONEvent("x.y", "x", "1", struct{}{})
	require.NoError(t, err)
	ctx := context.Background()
	require.Error(t, kafkatest.Publish(ctx, k.Brokers, "missing", e), "topics are not created on first use by default")

	auto := kafkatest.StartWith(t, kafkatest.Config{AutoCreateTopics: true})
	require.NoError(t, kafkatest.Publish(ctx, auto.Brokers, "created-on-use", e))
}

func TestStartUsesKafkaBrokersWhenSet(t *testing.T) {
	real := kafkatest.StartWith(t, kafkatest.Config{InProcess: true})
	t.Setenv(kafkatest.BrokersEnv, real.Brokers[0])
	topic := kafkatest.Topic("shared")

	t.Run("user", func(t *testing.T) {
		k := kafkatest.Start(t, topic)
		require.False(t, k.InProcess(), "KAFKA_BROKERS names the cluster to use")
		require.Equal(t, real.Brokers, k.Brokers)
		require.Contains(t, topicsOf(t, real.Brokers), topic)
	})
	// The topic the subtest created on the shared cluster is gone.
	deadline := time.Now().Add(10 * time.Second)
	for slices.Contains(topicsOf(t, real.Brokers), topic) {
		require.True(t, time.Now().Before(deadline), "topic %s was not deleted at cleanup", topic)
		time.Sleep(20 * time.Millisecond)
	}
}

func topicsOf(t *testing.T, brokers []string) []string {
	t.Helper()
	admin, err := internalkafka.Admin(brokers)
	require.NoError(t, err)
	defer admin.Close()
	topics, err := admin.ListTopics()
	require.NoError(t, err)
	var names []string
	for n := range topics {
		names = append(names, n)
	}
	return names
}
