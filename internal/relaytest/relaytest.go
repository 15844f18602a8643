// Package relaytest holds the helpers the producer's, the admin packages'
// and the command's tests share: publishing orders, running relays (and
// consumers, Background), and reading back what reached Kafka.
package relaytest

import (
	"cmp"
	"context"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// Logger logs warnings and errors through t.Log.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(p))
	return len(p), nil
}

// Setup returns a migrated schema made with opts, the Kafka brokers and a
// new "orders" topic with partitions partitions: what most relay tests
// start from.
func Setup(t *testing.T, opts pgtest.Options, partitions int32) (pgtest.Env, []string, string) {
	t.Helper()
	env := pgtest.New(t, opts)
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "orders")
	kafkatest.CreateTopic(t, brokers, topic, partitions)
	return env, brokers, topic
}

// Start is Run on env with short intervals (PollInterval 200ms,
// RebalanceInterval 250ms) and Logger unless cfg sets them.
func Start(t *testing.T, env pgtest.Env, cfg producer.RelayConfig) (*producer.Relay, func() time.Duration) {
	t.Helper()
	cfg.Schema = env.Schema
	cfg.PollInterval = cmp.Or(cfg.PollInterval, 200*time.Millisecond)
	cfg.RebalanceInterval = cmp.Or(cfg.RebalanceInterval, 250*time.Millisecond)
	if cfg.Logger == nil {
		cfg.Logger = Logger(t)
	}
	return Run(t, env.Pool, cfg)
}

// Run runs a relay until the returned stop is called (or the test ends);
// stop reports how long Run took to return.
func Run(t *testing.T, pool *pgxpool.Pool, cfg producer.RelayConfig) (*producer.Relay, func() time.Duration) {
	t.Helper()
	r, err := producer.NewRelay(context.Background(), pool, cfg)
	require.NoError(t, err)
	return r, Background(t, r.Run)
}

// Background runs run (a relay's or a consumer's Run) in a goroutine until
// the returned stop is called or the test ends. stop cancels run's
// context, requires it to return nil within a minute and reports how long
// that took; a run that returns before stop is called fails the test.
func Background(t testing.TB, run func(context.Context) error) (stop func() time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		err := run(ctx)
		if ctx.Err() == nil {
			t.Errorf("stopped on its own, before the test stopped it: %v", err)
		}
		done <- err
	}()
	var once sync.Once
	var took time.Duration
	stop = func() time.Duration {
		once.Do(func() {
			began := time.Now()
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(time.Minute):
				t.Error("did not stop within a minute")
			}
			took = time.Since(began)
		})
		return took
	}
	t.Cleanup(func() { stop() })
	return stop
}

// Event returns an order.updated event of aggregate order/aggID for topic.
func Event(t testing.TB, aggID, topic string, payload any) eventline.Event {
	t.Helper()
	e, err := eventline.NewJSONEvent("order.updated", "order", aggID, payload)
	require.NoError(t, err)
	e.ID, e.Topic = eventline.NewEventID(), topic
	return e
}

// PublishOrders publishes n events spread over aggs aggregates, in
// transactions of batch events.
func PublishOrders(t *testing.T, env pgtest.Env, topic string, aggs, n, batch int) []eventline.Event {
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

// IDs returns the events' ids.
func IDs(events []eventline.Event) []string {
	out := make([]string, len(events))
	for i, e := range events {
		out[i] = e.ID
	}
	return out
}

// Record is one event as read back from Kafka.
type Record struct {
	EventID   string
	Key       string
	Version   int64
	Partition int32
	Offset    int64
}

// ReadUntil reads topic from the start until done says so or the timeout
// passed.
func ReadUntil(t *testing.T, brokers []string, topic string, timeout time.Duration, done func([]Record) bool) []Record {
	t.Helper()
	var out []Record
	kafkatest.Consume(t, brokers, topic, timeout, func(m *sarama.ConsumerMessage) bool {
		r := Record{Key: string(m.Key), Partition: m.Partition, Offset: m.Offset}
		for _, h := range m.Headers {
			switch string(h.Key) {
			case eventline.MetaEventID:
				r.EventID = string(h.Value)
			case eventline.MetaAggregateVersion:
				r.Version, _ = strconv.ParseInt(string(h.Value), 10, 64)
			}
		}
		out = append(out, r)
		return done(out)
	})
	return out
}

// Distinct counts the records of each event id.
func Distinct(records []Record) map[string]int {
	out := map[string]int{}
	for _, r := range records {
		out[r.EventID]++
	}
	return out
}

// RequireAllDelivered reads topic until every id is there.
func RequireAllDelivered(t *testing.T, brokers []string, topic string, ids []string, timeout time.Duration) map[string]int {
	t.Helper()
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	// Counted as records arrive: recounting every record read at each one
	// took longer than the timeout for 16k events under load, and the
	// test reported them missing.
	seen, n, read := map[string]bool{}, 0, 0
	recs := ReadUntil(t, brokers, topic, timeout, func(recs []Record) bool {
		for _, r := range recs[read:] {
			if want[r.EventID] && !seen[r.EventID] {
				seen[r.EventID] = true
				n++
			}
		}
		read = len(recs)
		return n == len(want)
	})
	counts := Distinct(recs)
	missing := 0
	for id := range want {
		if counts[id] == 0 {
			missing++
		}
	}
	require.Zero(t, missing, "%d of %d committed events never reached Kafka", missing, len(want))
	return counts
}

// MoveToAHigherCounterCluster makes a shard look restored from a cluster
// whose transaction counter was far higher: the position and every row get
// ids this cluster has not handed out yet.
func MoveToAHigherCounterCluster(t *testing.T, env pgtest.Env, shard int) {
	t.Helper()
	ctx := context.Background()
	const shift = `(transaction_id::text::bigint + 1000000000)::text::xid8`
	_, err := env.Pool.Exec(ctx, `UPDATE `+sqlident.Qualify(env.Schema, outbox.Table(shard))+` SET transaction_id = `+shift)
	require.NoError(t, err)
	_, err = env.Pool.Exec(ctx, `UPDATE `+sqlident.Qualify(env.Schema, outbox.OffsetsTable(shard))+
		` SET last_processed_transaction_id = (last_processed_transaction_id::text::bigint + 1000000000)::text::xid8`)
	require.NoError(t, err)
}
