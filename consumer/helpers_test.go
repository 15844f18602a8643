package consumer_test

import (
	"context"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
)

func TestMain(m *testing.M) {
	if os.Getenv(crashChildEnv) != "" {
		// Re-executed as the crashing consumer process (see crash_test.go).
		os.Exit(m.Run())
	}
	goleak.VerifyTestMain(m,
		// sarama's metrics registry starts a process-wide meter ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// kenv is one test's database schema, Kafka cluster and topics.
type kenv struct {
	consumertest.Env
	brokers    []string
	topic, dlq string
}

func newKenv(t *testing.T, partitions int32) kenv {
	t.Helper()
	k := kenv{
		Env:     consumertest.New(t, pgtest.Options{MaxConns: 6}),
		brokers: kafkatest.Brokers(t),
		topic:   kafkatest.Topic(t, "events"),
		dlq:     kafkatest.Topic(t, "dlq"),
	}
	kafkatest.CreateTopic(t, k.brokers, k.topic, partitions)
	kafkatest.CreateTopic(t, k.brokers, k.dlq, 1)
	return k
}

// config is a consumer configuration for the test's topics with fast
// retries and a quiet logger.
func (k kenv) config(group string) consumer.Config {
	return consumer.Config{
		Brokers:              k.brokers,
		Group:                group,
		Topics:               []string{k.topic},
		Schema:               k.Schema,
		DeadLetterTopic:      k.dlq,
		MaxRetries:           2,
		RetryInitialInterval: 5 * time.Millisecond,
		RetryMaxInterval:     20 * time.Millisecond,
		SweepInterval:        50 * time.Millisecond,
		ShutdownTimeout:      20 * time.Second,
		SaramaConfig:         fastGroupConfig(group),
		Logger:               quietLogger(),
	}
}

// fastGroupConfig is kafkaconf.Consumer with quicker group rebalances.
func fastGroupConfig(group string) *sarama.Config {
	c := kafkaconf.Consumer("test-" + group)
	c.Consumer.Group.Rebalance.Timeout = 5 * time.Second
	c.Consumer.Group.Session.Timeout = 6 * time.Second
	c.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	c.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	return c
}

func quietLogger() *slog.Logger {
	if os.Getenv("EVENTLINE_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// applyHandler records each event through the business model.
func (k kenv) applyHandler(group string) consumer.HandlerFunc {
	return func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		return k.Apply(ctx, tx, group, e)
	}
}

// publish puts messages on a topic as the relay does: watermill-kafka's
// default marshaler, keyed by aggregate id.
func publish(t testing.TB, brokers []string, topic string, msgs ...*message.Message) {
	t.Helper()
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
			if k := m.Metadata.Get(eventline.MetaAggregateID); k != "" {
				return k, nil
			}
			return m.UUID, nil
		}),
		OverwriteSaramaConfig: kafkaconf.Producer("test-publisher"),
	}, watermill.NopLogger{})
	require.NoError(t, err)
	defer pub.Close()
	for _, m := range msgs {
		require.NoError(t, pub.Publish(topic, m))
	}
}

// running is a consumer started in the background.
type running struct {
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

func start(t *testing.T, c *consumer.Consumer) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx) }()
	t.Cleanup(func() { _ = r.stop() })
	return r
}

// stop cancels the consumer and waits for Run to return.
func (r *running) stop() error {
	r.once.Do(func() {
		r.cancel()
		r.err = <-r.done
	})
	return r.err
}

// eventually polls cond until it holds or the timeout passes.
func eventually(t *testing.T, timeout time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s: "+format, append([]any{timeout}, args...)...)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// deadLetters reads n records from the dead-letter topic.
func deadLetters(t *testing.T, k kenv, n int) []*sarama.ConsumerMessage {
	t.Helper()
	var out []*sarama.ConsumerMessage
	kafkatest.Consume(t, k.brokers, k.dlq, 60*time.Second, func(m *sarama.ConsumerMessage) bool {
		out = append(out, m)
		return len(out) >= n
	})
	require.Len(t, out, n, "dead letters")
	return out
}

func header(m *sarama.ConsumerMessage, key string) string {
	for _, h := range m.Headers {
		if string(h.Key) == key {
			return string(h.Value)
		}
	}
	return ""
}

// appliedOnce checks that every event in want was applied exactly once and
// that each aggregate's versions were applied in increasing order.
func appliedOnce(t *testing.T, effects []consumertest.Effect, want []eventline.Event) {
	t.Helper()
	count := map[string]int{}
	last := map[string]int64{}
	for _, e := range effects {
		count[e.EventID]++
		require.Greater(t, e.Version, last[e.AggregateID], "aggregate %s applied out of order", e.AggregateID)
		last[e.AggregateID] = e.Version
	}
	for _, e := range want {
		require.Equal(t, 1, count[e.ID], "event %s (%s v%d) must be applied exactly once", e.ID, e.AggregateID, e.AggregateVersion)
	}
	require.Len(t, effects, len(want), "no effect other than the expected ones")
}
