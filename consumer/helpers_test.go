package consumer_test

import (
	"context"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
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
	brokers []string
	topic   string
}

func newKenv(t *testing.T, partitions int32) kenv {
	t.Helper()
	return newKenvOn(t, kafkatest.Brokers(t), partitions)
}

// newFaultyKenv is newKenv on a Kafka cluster of the test's own (kfake, or
// an Apache Kafka broker) behind the fault proxy it returns.
func newFaultyKenv(t *testing.T, partitions int32) (kenv, *faultproxy.Proxy) {
	t.Helper()
	kc := kafkatest.WithFaults(t)
	return newKenvOn(t, kc.Brokers, partitions), kc.Proxy
}

func newKenvOn(t *testing.T, brokers []string, partitions int32) kenv {
	t.Helper()
	k := kenv{
		Env:     consumertest.New(t, pgtest.Options{MaxConns: 6}),
		brokers: brokers,
		topic:   kafkatest.Topic(t, "events"),
	}
	kafkatest.CreateTopic(t, k.brokers, k.topic, partitions)
	return k
}

// newConsumer returns a consumer of cfg on k's pool.
func (k kenv) newConsumer(t testing.TB, cfg consumer.Config) *consumer.Consumer {
	t.Helper()
	c, err := consumer.New(k.Pool, cfg)
	require.NoError(t, err)
	return c
}

// withMetrics gives cfg metrics of their own and returns their registry.
func withMetrics(t testing.TB, cfg *consumer.Config) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := middleware.NewMetrics(reg)
	require.NoError(t, err)
	cfg.Metrics = m
	return reg
}

// config is a consumer configuration for the test's topics with fast
// retries and a quiet logger.
func (k kenv) config(group string) consumer.Config {
	return consumer.Config{
		Config: middleware.Config{
			Group:         group,
			Schema:        k.Schema,
			MaxRetries:    2,
			SweepInterval: 50 * time.Millisecond,
			Logger:        quietLogger(),
			Retry:         eventline.Backoff{Initial: 5 * time.Millisecond, Max: 20 * time.Millisecond},
		},
		Brokers:         k.brokers,
		Topics:          []string{k.topic},
		ShutdownTimeout: 20 * time.Second,
		SaramaConfig:    fastGroupConfig(group),
	}
}

// clusterAdmin is a Kafka admin client for brokers; close it.
func clusterAdmin(t testing.TB, brokers []string) sarama.ClusterAdmin {
	t.Helper()
	admin, err := kafkatest.Admin(brokers)
	require.NoError(t, err)
	return admin
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

// mustRun fails the test when Run has returned (during, say, an outage).
func (r *running) mustRun(t *testing.T, during string) {
	t.Helper()
	select {
	case err := <-r.done:
		r.done <- err // for r.stop
		t.Fatalf("Run returned during %s: %v", during, err)
	default:
	}
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

// deadLetters waits for the group's n dead letters (held events of kind
// dead_letter) and returns them, as they were held.
func deadLetters(t *testing.T, k kenv, group string, n int) []admin.HeldEvent {
	t.Helper()
	var out []admin.HeldEvent
	eventually(t, 60*time.Second, func() bool {
		var err error
		out, err = admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{Kind: admin.HeldDeadLetter, Group: group})
		require.NoError(t, err)
		return len(out) >= n
	}, "%d dead letters", n)
	require.Len(t, out, n, "dead letters")
	return out
}

// appliedOnce checks that every event in want was applied exactly once and
// that each aggregate's versions were applied in increasing order
// (unversioned events have no order). Events are told apart by aggregate
// and id, as the dedup records are: an id reused by another aggregate is
// another event.
func appliedOnce(t *testing.T, effects []consumertest.Effect, want []eventline.Event) {
	t.Helper()
	type key struct{ typ, agg, id string }
	count := map[key]int{}
	last := map[string]int64{}
	for _, e := range effects {
		count[key{e.AggregateType, e.AggregateID, e.EventID}]++
		if e.Version == 0 {
			continue // unversioned: no order
		}
		require.Greater(t, e.Version, last[e.AggregateID], "aggregate %s applied out of order", e.AggregateID)
		last[e.AggregateID] = e.Version
	}
	for _, e := range want {
		require.Equal(t, 1, count[key{e.AggregateType, e.AggregateID, e.ID}], "event %s (%s v%d) must be applied exactly once", e.ID, e.AggregateID, e.AggregateVersion)
	}
	require.Len(t, effects, len(want), "no effect other than the expected ones")
}

// partitionStopping is what a partition logs (at debug level) when it is
// revoked or its consumer closes, before it waits for its in-flight events.
const partitionStopping = "eventline: partition stopping"

// watchLog returns a logger and a watch on the records whose message
// starts with msg, so a test can wait for what the consumer says it is
// doing instead of sleeping. It accepts every level; with
// EVENTLINE_TEST_LOG set it also prints.
func watchLog(msg string) (*slog.Logger, *logWatch) {
	w := &logWatch{msg: msg}
	h := &logHandler{w: w}
	if os.Getenv("EVENTLINE_TEST_LOG") != "" {
		h.next = slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})
	}
	return slog.New(h), w
}

// logWatch hands out channels closed by the next matching record.
type logWatch struct {
	msg     string
	mu      sync.Mutex
	waiters []chan struct{}
	matches []map[string]slog.Value // attributes of the matches since Next
}

// Next returns a channel closed when a matching record is logged after
// this call.
func (w *logWatch) Next() <-chan struct{} {
	ch := make(chan struct{})
	w.mu.Lock()
	w.matches = nil
	w.waiters = append(w.waiters, ch)
	w.mu.Unlock()
	return ch
}

// MaxInt returns the largest value of an integer attribute among the
// matching records logged since the last Next.
func (w *logWatch) MaxInt(key string) int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	var m int64
	for _, attrs := range w.matches {
		if v, ok := attrs[key]; ok && v.Kind() == slog.KindInt64 {
			m = max(m, v.Int64())
		}
	}
	return m
}

// String returns a string attribute of the last matching record logged
// since the last Next ("" if none).
func (w *logWatch) String(key string) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.matches) == 0 {
		return ""
	}
	if v, ok := w.matches[len(w.matches)-1][key]; ok {
		return v.String()
	}
	return ""
}

func (w *logWatch) saw(r slog.Record) {
	if !strings.HasPrefix(r.Message, w.msg) {
		return
	}
	attrs := map[string]slog.Value{}
	r.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.Resolve(); return true })
	w.mu.Lock()
	defer w.mu.Unlock()
	w.matches = append(w.matches, attrs)
	for _, ch := range w.waiters {
		close(ch)
	}
	w.waiters = nil
}

type logHandler struct {
	w    *logWatch
	next slog.Handler
}

func (h *logHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *logHandler) Handle(ctx context.Context, r slog.Record) error {
	h.w.saw(r)
	if h.next != nil {
		return h.next.Handle(ctx, r)
	}
	return nil
}

func (h *logHandler) WithAttrs(as []slog.Attr) slog.Handler {
	c := *h
	if h.next != nil {
		c.next = h.next.WithAttrs(as)
	}
	return &c
}

func (h *logHandler) WithGroup(name string) slog.Handler {
	c := *h
	if h.next != nil {
		c.next = h.next.WithGroup(name)
	}
	return &c
}

// waitFor waits for ch to close, failing the test after timeout.
func waitFor(t *testing.T, ch <-chan struct{}, timeout time.Duration, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(timeout):
		t.Fatalf("timed out after %s waiting for: %s", timeout, what)
	}
}
