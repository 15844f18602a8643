package producer_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
	"github.com/eventline/eventline/producer"
)

func TestRelayForwardsEveryEventKeyedByAggregate(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 4, MaxConns: 10}, 6)

	events := relaytest.PublishOrders(t, env, topic, 20, 500, 10)
	_, stop := relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, BatchSize: 64})

	records := readTopic(t, brokers, topic, len(events), 30*time.Second)
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
	const partitions = 6
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2}, partitions)
	events := relaytest.PublishOrders(t, env, topic, 50, 50, 10) // 50 aggregates, one event each
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers})

	java := kgo.StickyKeyPartitioner(nil).ForTopic(topic)
	moved := 0
	for _, r := range readTopic(t, brokers, topic, len(events), 30*time.Second) {
		if want := java.Partition(&kgo.Record{Key: []byte(r.Key)}, partitions); int32(want) != r.Partition {
			moved++
			t.Logf("key %s: partition %d, a Java client would use %d", r.Key, r.Partition, want)
		}
	}
	require.Zero(t, moved, "%d of %d keys in a different partition than Kafka's default partitioner picks", moved, len(events))
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

// exchangeTracer records what a relay's pool sends, one entry per round
// trip: a statement sent alone, or the statements of one batch.
type exchangeTracer struct {
	mu        sync.Mutex
	exchanges [][]string
	open      map[*pgx.Conn]int // the exchange a connection's batch is filling
}

func (tr *exchangeTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	tr.mu.Lock()
	tr.exchanges = append(tr.exchanges, []string{data.SQL})
	tr.mu.Unlock()
	return ctx
}

func (tr *exchangeTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (tr *exchangeTracer) TraceBatchStart(ctx context.Context, conn *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	tr.mu.Lock()
	tr.exchanges = append(tr.exchanges, nil)
	tr.open[conn] = len(tr.exchanges) - 1
	tr.mu.Unlock()
	return ctx
}

func (tr *exchangeTracer) TraceBatchQuery(_ context.Context, conn *pgx.Conn, data pgx.TraceBatchQueryData) {
	tr.mu.Lock()
	i := tr.open[conn]
	tr.exchanges[i] = append(tr.exchanges[i], data.SQL)
	tr.mu.Unlock()
}

func (tr *exchangeTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (tr *exchangeTracer) snapshot() [][]string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return append([][]string(nil), tr.exchanges...)
}

func startsWith(sql, prefix string) bool {
	return strings.HasPrefix(strings.ToUpper(strings.TrimSpace(sql)), prefix)
}

// TestRelayTransactionTakesTwoRoundTrips: a relay transaction sends BEGIN
// and the read (which applies the transaction's settings) in one round
// trip, and the position write and COMMIT in another: four statements.
// Before, BEGIN (with its settings, SET LOCAL statements), the read, the
// position write and COMMIT were four round trips and six statements.
func TestRelayTransactionTakesTwoRoundTrips(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2}, 2)
	tr := &exchangeTracer{open: map[*pgx.Conn]int{}}
	pool := tracedRelayPool(t, env, tr)
	relaytest.Start(t, pgtest.Env{Pool: pool, Schema: env.Schema, Shards: env.Shards}, producer.RelayConfig{Brokers: brokers})

	// Events one at a time, once the shards have started, so that most
	// batches hold one.
	require.Eventually(t, func() bool { return waitingShards(t, env) == env.Shards }, 15*time.Second, 10*time.Millisecond)
	var ids []string
	for range 10 {
		ids = append(ids, relaytest.IDs(relaytest.PublishOrders(t, env, topic, 3, 1, 1))...)
		time.Sleep(20 * time.Millisecond)
	}
	relaytest.RequireAllDelivered(t, brokers, topic, ids, 30*time.Second)
	require.Eventually(t, func() bool {
		st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
		require.NoError(t, err)
		return st.Backlog() == 0
	}, 30*time.Second, 10*time.Millisecond)

	var reads, writes int
	for _, ex := range tr.snapshot() {
		for i, sql := range ex {
			switch {
			case strings.Contains(sql, "WITH last_processed AS"):
				reads++
				require.Len(t, ex, 2, "the read travels with BEGIN: %q", ex)
				require.True(t, startsWith(ex[0], "BEGIN"), "%q", ex)
				require.Equal(t, 1, i, "%q", ex)
			case strings.Contains(sql, "offset_acked = excluded.offset_acked"):
				writes++
				require.True(t, startsWith(ex[len(ex)-1], "COMMIT"), "the position write travels with COMMIT: %q", ex)
			case len(ex) == 1 && (startsWith(sql, "BEGIN ISOLATION LEVEL REPEATABLE READ") || startsWith(sql, "SET LOCAL")):
				// (A shard's set-up runs a READ COMMITTED transaction of
				// its own, once.)
				t.Fatalf("a relay transaction sent %q in a round trip of its own", sql)
			}
		}
	}
	t.Logf("%d reads, %d position writes for %d events", reads, writes, len(ids))
	// How many batches the ten events make depends on the machine's load
	// (a slow broker gathers them into one); each batch's shape does not.
	require.Positive(t, reads)
	require.Positive(t, writes)
}

// TestRelayNeverOverwritesAPositionMovedDuringItsBatch: a relay
// transaction reads under REPEATABLE READ, so its position write fails
// when another writer moved the position after it read (two relays that
// both believe they own the shard); its COMMIT, sent in the same round
// trip, must then not run, and the newer position stays. Here the other
// writer moves the position past B while the relay's batch holds A.
func TestRelayNeverOverwritesAPositionMovedDuringItsBatch(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	ctx := context.Background()
	evs := relaytest.PublishOrders(t, env, topic, 1, 2, 1) // A, then B, in transactions of their own
	a, b := evs[0], evs[1]
	offsets := sqlident.Qualify(env.Schema, outbox.OffsetsTable(0))
	var bTx string
	var bOffset int64
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT transaction_id::text, "offset" FROM `+sqlident.Qualify(env.Schema, outbox.Table(0))+
		` ORDER BY transaction_id DESC, "offset" DESC LIMIT 1`).Scan(&bTx, &bOffset))

	var once sync.Once
	moved := make(chan struct{})
	logs := newLogRecorder(t, slog.LevelWarn)
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, BatchSize: 1, Logger: slog.New(logs),
		AfterPublish: func(_ int, ids []string) error {
			once.Do(func() {
				require.Equal(t, []string{a.ID}, ids)
				_, err := env.Pool.Exec(ctx, `UPDATE `+offsets+` SET last_processed_transaction_id = $1::text::xid8, offset_acked = $2 WHERE consumer_group = $3`,
					bTx, bOffset, outbox.RelayConsumerGroup)
				require.NoError(t, err)
				close(moved)
			})
			return nil
		}})
	relaytest.RequireAllDelivered(t, brokers, topic, []string{a.ID}, 30*time.Second)
	<-moved
	require.Eventually(t, func() bool {
		return strings.Contains(strings.Join(logs.at(slog.LevelWarn), "\n"), "record relay progress")
	}, 10*time.Second, 10*time.Millisecond,
		"the relay's write of A's position must fail")
	time.Sleep(1500 * time.Millisecond) // the shard reads again after queryRetryInterval (1s)
	tx, off, err := positionOf(ctx, env.Pool, env.Schema, 0)
	require.NoError(t, err)
	require.Equal(t, bTx, strconv.FormatUint(tx, 10), "the position moved back")
	require.Equal(t, bOffset, off, "the position moved back")
	recs := relaytest.ReadUntil(t, brokers, topic, time.Second, func([]relaytest.Record) bool { return false })
	require.Zero(t, relaytest.Distinct(recs)[b.ID], "B, behind the moved position, was read again")
}

// TestRelayForwardsCommittedEventsOnceUnderOverlappingTransactions runs
// many producers whose transactions overlap and commit out of start order,
// some holding an early transaction id for a long time, some rolling back,
// while the relay runs. Every committed event must reach Kafka exactly once
// (nothing skipped because it committed late), and nothing rolled back.
func TestRelayForwardsCommittedEventsOnceUnderOverlappingTransactions(t *testing.T) {
	t.Parallel()
	env, brokers, topic, p := setupWithProducer(t, pgtest.Options{Shards: 4, MaxConns: 20}, 6)
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, BatchSize: 16})

	var mu sync.Mutex
	committed, rolledBack := map[string]bool{}, map[string]bool{}
	var wg sync.WaitGroup
	for w := 0; w < 12; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := 0; i < 25; i++ {
				var events []eventline.Event
				for j := 0; j <= rng.IntN(3); j++ {
					e, err := eventline.NewJSONEvent("order.updated", "order", "agg-"+strconv.Itoa(rng.IntN(10)), map[string]int{"w": w})
					require.NoError(t, err)
					e.ID = eventline.NewEventID()
					events = append(events, e)
				}
				rollback := rng.IntN(5) == 0
				err := pgx.BeginFunc(context.Background(), env.Pool, func(tx pgx.Tx) error {
					if rng.IntN(4) == 0 {
						// Take a transaction id now and write much later: this
						// row sorts early in the outbox but commits late.
						if _, err := tx.Exec(context.Background(), `SELECT pg_current_xact_id()`); err != nil {
							return err
						}
						time.Sleep(time.Duration(50+rng.IntN(150)) * time.Millisecond)
					}
					if err := p.PublishTx(context.Background(), tx, events...); err != nil {
						return err
					}
					time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
					if rollback {
						return errRollback
					}
					return nil
				})
				if rollback {
					require.ErrorIs(t, err, errRollback)
				} else {
					require.NoError(t, err)
				}
				mu.Lock()
				for _, e := range events {
					if rollback {
						rolledBack[e.ID] = true
					} else {
						committed[e.ID] = true
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	require.NotEmpty(t, rolledBack)

	records := readTopic(t, brokers, topic, len(committed), time.Minute)
	// Read on for a moment: a late duplicate or rolled-back event would
	// show up here.
	records = relaytest.ReadUntil(t, brokers, topic, 2*time.Second, func(r []relaytest.Record) bool { return len(r) > len(records) })
	counts := relaytest.Distinct(records)
	for id := range committed {
		require.Equal(t, 1, counts[id], "committed event %s must be forwarded exactly once", id)
	}
	for id := range rolledBack {
		require.Zero(t, counts[id], "rolled-back event %s was forwarded", id)
	}
	require.Len(t, counts, len(committed))
}

var errRollback = errorString("roll back on purpose")

type errorString string

func (e errorString) Error() string { return string(e) }

// TestXidOrderCanInvertVersions builds the inversion DESIGN.md describes on
// purpose: transaction A takes its transaction id first but locks the
// aggregate last, so its version 2 sorts before B's version 1 in the outbox
// and reaches Kafka first. The relay must not "fix" this by reordering (it
// acknowledges by offset); the consumer's version gate restores order,
// which the end-to-end tests check.
func TestXidOrderCanInvertVersions(t *testing.T) {
	t.Parallel()
	env, brokers, topic, p := setupWithProducer(t, pgtest.Options{Shards: 1}, 1)
	ctx := context.Background()

	txA := mustTx(t, env)
	_, err := txA.Exec(ctx, `SELECT pg_current_xact_id()`) // A's xid is older
	require.NoError(t, err)

	b := relaytest.Event(t, "X", topic, "b")
	require.NoError(t, p.Publish(ctx, env.Pool, b)) // B: version 1, commits first
	a := relaytest.Event(t, "X", topic, "a")
	require.NoError(t, p.PublishTx(ctx, txA, a)) // A: version 2
	require.NoError(t, txA.Commit(ctx))

	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers})
	recs := readTopic(t, brokers, topic, 2, 30*time.Second)
	require.Len(t, recs, 2)
	require.Equal(t, []int64{2, 1}, []int64{recs[0].Version, recs[1].Version},
		"outbox order is transaction-id order, not commit or version order")
}

// publishTraced publishes e inside a "place order" span of rec and
// returns that span's context.
func publishTraced(t *testing.T, env pgtest.Env, rec *tracingtest.Recorder, topic string, e eventline.Event) trace.SpanContext {
	t.Helper()
	p, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic, Propagator: tracing.DefaultPropagator()})
	require.NoError(t, err)
	ctx, span := rec.Provider.Tracer("test").Start(context.Background(), "place order")
	require.NoError(t, p.Publish(ctx, env.Pool, e))
	span.End()
	return span.SpanContext()
}

// waitSpans waits until rec has ended n spans called name.
func waitSpans(t *testing.T, rec *tracingtest.Recorder, name string, n int) tracetest.SpanStubs {
	t.Helper()
	require.Eventually(t, func() bool { return len(rec.Named(name)) >= n }, 30*time.Second, 10*time.Millisecond, "no %q span ended", name)
	return rec.Named(name)
}

// traceSetup gives a relay test a one-shard outbox, a one-partition topic
// on in-process Kafka and an in-memory span recorder.
func traceSetup(t *testing.T) (pgtest.Env, []string, string, *tracingtest.Recorder) {
	t.Helper()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1, MaxConns: 6}, 1)
	return env, brokers, topic, tracingtest.New(t)
}

// TestRelaySendSpanContinuesThePublishTrace: with a TracerProvider, the
// relay records "send <topic>" (producer kind) as a child of the span
// PublishTx captured, with the messaging and eventline attributes, and
// the Kafka record carries the send span's traceparent.
func TestRelaySendSpanContinuesThePublishTrace(t *testing.T) {
	t.Parallel()
	env, brokers, topic, rec := traceSetup(t)

	e, err := eventline.NewJSONEvent("order.placed", "order", "o-1", map[string]int{"qty": 1})
	require.NoError(t, err)
	e.ID = eventline.NewEventID()
	parent := publishTraced(t, env, rec, topic, e)
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, TracerProvider: rec.Provider})

	var headers map[string]string
	kafkatest.Consume(t, brokers, topic, 30*time.Second, func(m *sarama.ConsumerMessage) bool {
		headers = map[string]string{}
		for _, h := range m.Headers {
			headers[string(h.Key)] = string(h.Value)
		}
		return true
	})
	sends := waitSpans(t, rec, "send "+topic, 1)
	s := sends[0]
	require.Equal(t, trace.SpanKindProducer, s.SpanKind)
	require.Equal(t, parent.TraceID(), s.SpanContext.TraceID(), "one trace from publish to send")
	require.Equal(t, parent.SpanID(), s.Parent.SpanID(), "send is a child of the publishing span")
	for k, want := range map[string]string{
		"messaging.system": "kafka", "messaging.destination.name": topic, "messaging.message.id": e.ID,
		"messaging.operation.type": "send", "messaging.destination.partition.id": "0", "messaging.kafka.offset": "0",
		"eventline.aggregate.type": "order", "eventline.aggregate.id": "o-1", "eventline.aggregate.version": "1",
	} {
		got, ok := tracingtest.Attr(s, k)
		require.True(t, ok, "attribute %s missing", k)
		require.Equal(t, want, got, "attribute %s", k)
	}
	require.Contains(t, headers[eventline.MetaTraceParent], s.SpanContext.SpanID().String(),
		"the record carries the send span's context for the consumer to continue")
	require.True(t, strings.HasPrefix(headers[eventline.MetaTraceParent], "00-"+parent.TraceID().String()))
}

// TestRelaySendSpanRecordsKafkaError: a record Kafka's producer refuses
// (larger than MaxMessageBytes) ends its send span with an error status
// and the error recorded.
func TestRelaySendSpanRecordsKafkaError(t *testing.T) {
	t.Parallel()
	env, brokers, topic, rec := traceSetup(t)

	e, err := eventline.NewJSONEvent("order.placed", "order", "o-big", map[string]string{"blob": strings.Repeat("x", 4000)})
	require.NoError(t, err)
	publishTraced(t, env, rec, topic, e)
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, TracerProvider: rec.Provider, MaxMessageBytes: 2048, MaxAttempts: 1})

	s := waitSpans(t, rec, "send "+topic, 1)[0]
	require.Equal(t, codes.Error, s.Status.Code, "Kafka's refusal is the span's status")
	require.NotEmpty(t, s.Events, "the error is recorded as an exception event")
	require.Equal(t, "exception", s.Events[0].Name)
}

// TestRelayWithoutTracerProviderLeavesTheTraceparent: tracing off, the
// record carries the publisher's traceparent as it was stored.
func TestRelayWithoutTracerProviderLeavesTheTraceparent(t *testing.T) {
	t.Parallel()
	env, brokers, topic, rec := traceSetup(t)

	e, err := eventline.NewJSONEvent("order.placed", "order", "o-2", map[string]int{"qty": 1})
	require.NoError(t, err)
	parent := publishTraced(t, env, rec, topic, e)
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers})
	var tp string
	kafkatest.Consume(t, brokers, topic, 30*time.Second, func(m *sarama.ConsumerMessage) bool {
		for _, h := range m.Headers {
			if string(h.Key) == eventline.MetaTraceParent {
				tp = string(h.Value)
			}
		}
		return true
	})
	require.Contains(t, tp, parent.SpanID().String())
	require.Len(t, rec.Spans(), 1, "only the test's own span: the relay made none")
}

// setupWithProducer is relaytest.Setup with a producer whose default topic
// is the new topic.
func setupWithProducer(t *testing.T, opts pgtest.Options, partitions int32) (pgtest.Env, []string, string, *producer.Producer) {
	t.Helper()
	env, brokers, topic := relaytest.Setup(t, opts, partitions)
	return env, brokers, topic, newProducerWith(t, env, producer.Config{DefaultTopic: topic})
}

// readTopic reads topic until want distinct event ids were seen or the
// timeout passed, and returns every record read (duplicates included).
func readTopic(t *testing.T, brokers []string, topic string, want int, timeout time.Duration) []relaytest.Record {
	t.Helper()
	seen, read := map[string]bool{}, 0 // counted as records arrive, not again at each one
	return relaytest.ReadUntil(t, brokers, topic, timeout, func(recs []relaytest.Record) bool {
		for _, r := range recs[read:] {
			seen[r.EventID] = true
		}
		read = len(recs)
		return len(seen) >= want
	})
}
