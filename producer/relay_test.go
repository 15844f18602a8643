package producer_test

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/producer"
)

// testLogger logs warnings and errors through t.Log.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(p))
	return len(p), nil
}

// startRelay runs a relay until the test ends or stop is called.
func startRelay(t *testing.T, env pgtest.Env, cfg producer.RelayConfig) (*producer.Relay, func()) {
	t.Helper()
	cfg.Schema = env.Schema
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 200 * time.Millisecond
	}
	if cfg.RebalanceInterval == 0 {
		cfg.RebalanceInterval = 250 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	r, err := producer.NewRelay(context.Background(), env.Pool, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(time.Minute):
				t.Error("relay did not stop within a minute")
			}
		})
	}
	t.Cleanup(stop)
	return r, stop
}

// publishOrders publishes n events spread over aggs aggregates, in
// transactions of batch events.
func publishOrders(t *testing.T, env pgtest.Env, topic string, aggs, n, batch int) []eventline.Event {
	t.Helper()
	p, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic})
	require.NoError(t, err)
	var all []eventline.Event
	for i := 0; i < n; i += batch {
		var events []eventline.Event
		for j := i; j < min(i+batch, n); j++ {
			e, err := eventline.NewJSONEvent("order.updated", "order", "agg-"+strconv.Itoa(j%aggs), map[string]int{"seq": j})
			require.NoError(t, err)
			e.ID = eventline.NewEventID()
			events = append(events, e)
		}
		require.NoError(t, p.Publish(context.Background(), env.Pool, events...))
		all = append(all, events...)
	}
	return all
}

// record is one event as read back from Kafka.
type record struct {
	eventID   string
	key       string
	version   int64
	partition int32
	offset    int64
}

// readTopic reads topic until want distinct event ids were seen or the
// timeout passed, and returns every record read (duplicates included).
func readTopic(t *testing.T, brokers []string, topic string, want int, timeout time.Duration) []record {
	t.Helper()
	seen, read := map[string]bool{}, 0 // counted as records arrive, not again at each one
	return readUntil(t, brokers, topic, timeout, func(recs []record) bool {
		for _, r := range recs[read:] {
			seen[r.eventID] = true
		}
		read = len(recs)
		return len(seen) >= want
	})
}

// readUntil reads topic from the start until done says so or the timeout
// passed.
func readUntil(t *testing.T, brokers []string, topic string, timeout time.Duration, done func([]record) bool) []record {
	t.Helper()
	var out []record
	kafkatest.Consume(t, brokers, topic, timeout, func(m *sarama.ConsumerMessage) bool {
		r := record{key: string(m.Key), partition: m.Partition, offset: m.Offset}
		for _, h := range m.Headers {
			switch string(h.Key) {
			case eventline.MetaEventID:
				r.eventID = string(h.Value)
			case eventline.MetaAggregateVersion:
				r.version, _ = strconv.ParseInt(string(h.Value), 10, 64)
			}
		}
		out = append(out, r)
		return done(out)
	})
	return out
}

func distinct(records []record) map[string]int {
	out := map[string]int{}
	for _, r := range records {
		out[r.eventID]++
	}
	return out
}

func TestRelayForwardsEveryEventKeyedByAggregate(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 4, MaxConns: 10})
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "orders")
	kafkatest.CreateTopic(t, brokers, topic, 6)

	events := publishOrders(t, env, topic, 20, 500, 10)
	_, stop := startRelay(t, env, producer.RelayConfig{Brokers: brokers, BatchSize: 64})

	records := readTopic(t, brokers, topic, len(events), 30*time.Second)
	counts := distinct(records)
	require.Len(t, counts, len(events), "every committed event reaches Kafka")
	for _, e := range events {
		require.Equal(t, 1, counts[e.ID], "event %s forwarded exactly once without crashes", e.ID)
	}

	// Keyed by aggregate id: one aggregate, one partition, versions in order.
	partitionOf := map[string]int32{}
	lastVersion := map[string]int64{}
	for _, r := range records {
		if p, ok := partitionOf[r.key]; ok {
			require.Equal(t, p, r.partition, "aggregate %s split over partitions", r.key)
		}
		partitionOf[r.key] = r.partition
		require.Greater(t, r.version, lastVersion[r.key], "aggregate %s out of order", r.key)
		lastVersion[r.key] = r.version
	}

	stop()
	st, err := producer.ReadStatus(context.Background(), env.Pool, env.Schema)
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
	events := publishOrders(t, env, topic, 50, 50, 10) // 50 aggregates, one event each
	startRelay(t, env, producer.RelayConfig{Brokers: brokers})

	java := kgo.StickyKeyPartitioner(nil).ForTopic(topic)
	moved := 0
	for _, r := range readTopic(t, brokers, topic, len(events), 30*time.Second) {
		if want := java.Partition(&kgo.Record{Key: []byte(r.key)}, partitions); int32(want) != r.partition {
			moved++
			t.Logf("key %s: partition %d, a Java client would use %d", r.key, r.partition, want)
		}
	}
	require.Zero(t, moved, "%d of %d keys in a different partition than Kafka's default partitioner picks", moved, len(events))
}

func TestNewRelayValidatesConfig(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	_, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{
		Schema: env.Schema, Brokers: []string{"nohostport"}, BatchSize: -1, Backoff: []time.Duration{},
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
