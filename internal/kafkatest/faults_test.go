package kafkatest_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
)

// A client of a Kafka with faults (kfake, or an Apache Kafka broker of its
// own in real-broker mode) sees each of the proxy's modes: answered in
// Pass, no answer in Freeze (its request times out, the connection stays
// open), refused and reset in Refuse + Drop, and answered again in Pass.
// Every connection goes through the proxy, the ones to the address the
// metadata advertises included.
func TestFaultsModes(t *testing.T) {
	t.Parallel()
	k := kafkatest.WithFaults(t)
	require.NotNil(t, k.Proxy)
	topic := kafkatest.Topic(t, "faults")
	require.NoError(t, k.CreateTopics(context.Background(), 1, topic))
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	cfg.Net.ReadTimeout = 300 * time.Millisecond
	cfg.Metadata.Retry.Max = 0
	client, err := sarama.NewClient(k.Brokers, cfg)
	require.NoError(t, err)
	defer client.Close()
	for _, b := range client.Brokers() {
		require.Equal(t, k.Proxy.Addr(), b.Addr(), "the metadata advertises the proxy")
	}
	answers := func() bool { return client.RefreshMetadata(topic) == nil }
	require.True(t, answers())
	require.Positive(t, k.Proxy.Conns())

	k.Proxy.Set(faultproxy.Freeze)
	require.Equal(t, faultproxy.Freeze, k.Proxy.Mode())
	require.False(t, answers(), "a frozen broker does not answer")
	k.Proxy.Set(faultproxy.Pass)
	require.Eventually(t, answers, 10*time.Second, 50*time.Millisecond, "answered again after the freeze")

	k.Proxy.Set(faultproxy.Refuse)
	k.Proxy.Drop()
	require.Zero(t, k.Proxy.Conns())
	require.False(t, answers(), "a refusing broker does not answer")
	require.Positive(t, k.Proxy.Refused(), "the client tried to reconnect")
	k.Proxy.Set(faultproxy.Pass)
	require.Eventually(t, answers, 10*time.Second, 50*time.Millisecond, "answered again after the refusal")
}

// A cluster of its own keeps its topics and records across Crash and
// Restart, at the same address, behind its proxy too: kfake with Persist,
// or an Apache Kafka broker killed with SIGKILL.
func TestCrashAndRestartKeepTheData(t *testing.T) {
	t.Parallel()
	for _, faults := range []bool{false, true} {
		k := kafkatest.Start(t, kafkatest.Config{Own: true, Persist: true, Faults: faults})
		topic := kafkatest.Topic(t, "crash")
		ctx := context.Background()
		require.NoError(t, k.CreateTopics(ctx, 2, topic))
		produce(t, k.Brokers, topic, 5)
		require.NoError(t, k.Crash())
		require.NoError(t, k.Restart(ctx))
		recs, err := kafkatest.ReadTopic(ctx, k.Brokers, topic)
		require.NoError(t, err)
		require.Len(t, recs, 5, "faults %v", faults)
	}
}

func produce(t *testing.T, brokers []string, topic string, n int) {
	t.Helper()
	cfg := kafkaconf.Producer("kafkatest-produce")
	p, err := sarama.NewSyncProducer(brokers, cfg)
	require.NoError(t, err)
	defer p.Close()
	for range n {
		_, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("k"), Value: sarama.StringEncoder("v")})
		require.NoError(t, err)
	}
}

// TestApacheKafkaCapsMinInsyncAtTheReplicationFactor shows why a one-node
// Apache Kafka cannot stand in for kfake's NOT_ENOUGH_REPLICAS fault: a
// topic of one replica whose min.insync.replicas is 2 still takes acks=all
// produces, since Kafka 4 caps the minimum at the replication factor. The
// relay's handling of that retriable error is tested on kfake
// (producer.TestRelayWaitsOutBrokerErrors); on Apache Kafka the chaos and
// outage tests take the broker away instead.
func TestApacheKafkaCapsMinInsyncAtTheReplicationFactor(t *testing.T) {
	kafkatest.NeedReal(t)
	t.Parallel()
	k := kafkatest.Start(t, kafkatest.Config{})
	topic := kafkatest.Topic(t, "min-insync")
	require.NoError(t, k.CreateTopicsWithConfig(context.Background(), 1, map[string]string{"min.insync.replicas": "2"}, topic))
	produce(t, k.Brokers, topic, 3) // acks=all (kafkaconf.Producer)
}
