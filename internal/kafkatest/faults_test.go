package kafkatest_test

import (
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
)

// A client connected to the cluster sees each mode: answered in Pass, no
// answer in Freeze (its request times out, the connection stays open),
// refused and reset in Refuse + Drop, and answered again in Pass.
func TestFaultsModes(t *testing.T) {
	t.Parallel()
	_, brokers, faults := kafkatest.FakeWithFaults(t)
	topic := kafkatest.Topic(t, "faults")
	kafkatest.CreateTopic(t, brokers, topic, 1)
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	cfg.Net.ReadTimeout = 300 * time.Millisecond
	cfg.Metadata.Retry.Max = 0
	client, err := sarama.NewClient(brokers, cfg)
	require.NoError(t, err)
	defer client.Close()
	answers := func() bool { return client.RefreshMetadata(topic) == nil }
	require.True(t, answers())
	require.Positive(t, faults.Conns())

	faults.Set(faultproxy.Freeze)
	require.Equal(t, faultproxy.Freeze, faults.Mode())
	require.False(t, answers(), "a frozen broker does not answer")
	faults.Set(faultproxy.Pass)
	require.Eventually(t, answers, 10*time.Second, 50*time.Millisecond, "answered again after the freeze")

	faults.Set(faultproxy.Refuse)
	faults.Drop()
	require.Zero(t, faults.Conns())
	require.False(t, answers(), "a refusing broker does not answer")
	require.Positive(t, faults.Refused(), "the client tried to reconnect")
	faults.Set(faultproxy.Pass)
	require.Eventually(t, answers, 10*time.Second, 50*time.Millisecond, "answered again after the refusal")
}
