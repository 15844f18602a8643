package producer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/IBM/sarama"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/eapache/go-resiliency/breaker"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
)

// TestRelayReadAppliesTheTransactionSettings: the relay's read applies its
// transaction's settings (relaySettings) when it takes the shard's fence,
// the case in which the transaction may then write and wait: its commit
// does not wait for the WAL flush, and PostgreSQL ends it after
// txTimeout+commitTimeout idle. They used to be SET LOCAL statements of
// their own.
func TestRelayReadAppliesTheTransactionSettings(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	_, err := env.Pool.Exec(ctx, newShardSQL(env.Schema, 0).zeroOffsets, outbox.RelayConsumerGroup)
	require.NoError(t, err)
	q, err := relaySchemaAdapter{outbox.SchemaAdapter(env.Schema, 500)}.SelectQuery(wsql.SelectQueryParams{
		Topic: outbox.Topic(0), ConsumerGroup: outbox.RelayConsumerGroup, OffsetsAdapter: newRelayOffsetsAdapter(env.Schema, 0)})
	require.NoError(t, err)
	settings := func(tx pgx.Tx) (syncCommit, idleTimeout string) {
		require.NoError(t, tx.QueryRow(ctx, `SELECT current_setting('synchronous_commit'),
			(SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout')`).Scan(&syncCommit, &idleTimeout))
		return syncCommit, idleTimeout
	}
	read := func() pgx.Tx {
		tx, err := env.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		for range 7 { // past PostgreSQL's custom plans: the generic plan must apply them too
			rows, err := tx.Query(ctx, q.Query, q.Args...)
			require.NoError(t, err)
			rows.Close()
			require.NoError(t, rows.Err())
		}
		return tx
	}
	plain, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defaultSync, defaultIdle := settings(plain)
	require.NoError(t, plain.Rollback(ctx))

	holder := read()
	sc, idle := settings(holder)
	require.Equal(t, "off", sc)
	require.Equal(t, strconv.FormatInt((txTimeout+commitTimeout).Milliseconds(), 10), idle)

	// Another transaction that does not get the fence reads nothing and
	// keeps the session's settings.
	other := read()
	sc, idle = settings(other)
	require.Equal(t, defaultSync, sc)
	require.Equal(t, defaultIdle, idle)
}

// TestTickNeverRelaysAShardWhoseLeaseReapReleased: a shard released to
// rebalance keeps its lease until its runner ends; the ownership loop then
// deletes the lease (reap). When the runner ends between a tick's renewal
// and its reap, the renewal still lists the shard as held. Before the fix
// the tick then restarted the shard on the strength of that renewal,
// after reap had deleted its lease: the shard ran without a lease (another
// relay could take it meanwhile) until the next renewal stopped it. Every
// shard a relay runs must have a lease row naming it.
func TestTickNeverRelaysAShardWhoseLeaseReapReleased(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	r, err := NewRelay(ctx, env.Pool, RelayConfig{Schema: env.Schema, Brokers: []string{"127.0.0.1:1"},
		RebalanceInterval: time.Second, PollInterval: time.Second, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	o := &ownership{r: r, sql: newLeaseSQL(env.Schema), released: map[int]bool{}}
	t.Cleanup(o.shutdown)
	require.NoError(t, o.connect(ctx))
	var epoch int64
	require.NoError(t, o.conn.QueryRow(ctx, o.sql.take, 0, r.instance, r.leaseTTL().Seconds()).Scan(&epoch))

	// Shard 0 was released to rebalance, and its runner has just ended,
	// after the renewal the next tick makes: reap will delete its lease.
	ended := &shardRunner{relay: r, shard: 0, done: make(chan struct{}), leaseTimer: time.AfterFunc(time.Hour, func() {})}
	ended.soft, ended.cancelSoft = context.WithCancel(ctx)
	ended.hard, ended.cancelHard = context.WithCancel(ctx)
	ended.halt(stopReleased)
	ended.cancelHard()
	close(ended.done)
	r.mu.Lock()
	r.running[0] = ended
	r.mu.Unlock()
	o.released[0] = true

	// The share (one live relay, one shard) wants the shard back.
	require.NoError(t, o.tick(ctx))
	require.Equal(t, []int{0}, r.ownedShards(), "the shard is relayed again")
	for _, shard := range r.ownedShards() {
		var n int
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, "relay_leases")+
			` WHERE shard = $1 AND owner = $2 AND expires_at > clock_timestamp()`, shard, r.instance).Scan(&n))
		require.Equal(t, 1, n, "shard %d runs without a lease", shard)
	}
}

// TestPollIntervalFollowsTheRelaysRate: while shards linger the poller
// polls about once per row the relay relays, between every 2 ms (from 500
// rows/s up) and every 10 ms (at 100 rows/s and below, or idle). Before,
// it polled every 2 ms at any rate: 2.8 polls per event at 100 events/s.
func TestPollIntervalFollowsTheRelaysRate(t *testing.T) {
	for _, c := range []struct {
		rate float64 // rows per second
		want time.Duration
	}{
		{0, maxHotPollInterval},
		{20, maxHotPollInterval},
		{100, maxHotPollInterval},
		{250, 4 * time.Millisecond},
		{500, hotPollInterval},
		{5000, hotPollInterval},
	} {
		p := newPoller(nil)
		p.rows, p.rowsAt = c.rate*rateWindow.Seconds(), time.Now()
		got := p.rateInterval()
		require.InDelta(t, float64(c.want), float64(got), float64(c.want)/50, "at %.0f rows/s", c.rate)
	}

	// The estimate follows the rows relayed: 200 rows/s for ten
	// seconds, in batches of two, ending now...
	p := newPoller(nil)
	now := time.Now()
	for ms := -10000; ms <= 0; ms += 10 {
		p.mu.Lock()
		p.decay(now.Add(time.Duration(ms) * time.Millisecond))
		p.rows += 2
		p.mu.Unlock()
	}
	require.InDelta(t, float64(5*time.Millisecond), float64(p.rateInterval()), float64(time.Millisecond)/5)
	// ... and decays once they stop.
	p.mu.Lock()
	p.rowsAt = p.rowsAt.Add(-3 * rateWindow)
	p.mu.Unlock()
	require.Equal(t, maxHotPollInterval, p.rateInterval())
}

// TestRelayAppNameKeepsTheOperatorsName: the relay's sessions keep the
// name the operator gave the pool and add the relay's identity, within
// PostgreSQL's 63 bytes.
func TestRelayAppNameKeepsTheOperatorsName(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"":                              "eventline-relay",
		"   ":                           "eventline-relay",
		"eventline-relay":               "eventline-relay",
		"billing-svc":                   "billing-svc (eventline-relay)",
		"billing-svc (eventline-relay)": "billing-svc (eventline-relay)",
		"eventline relay":               "eventline relay (eventline-relay)",
		strings.Repeat("x", 60):         strings.Repeat("x", 45) + " (eventline-relay)",
		strings.Repeat("é", 30):         strings.Repeat("é", 22) + " (eventline-relay)",
	} {
		require.Equal(t, want, relayAppName(in), "from %q", in)
	}
	rapid.Check(t, func(t *rapid.T) {
		name := rapid.OneOf(rapid.String(), rapid.StringMatching(`[ -~]{0,80}`)).Draw(t, "name")
		got := relayAppName(name)
		if len(got) > maxAppNameBytes {
			t.Fatalf("%q is %d bytes, over PostgreSQL's %d", got, len(got), maxAppNameBytes)
		}
		if utf8.ValidString(name) && !utf8.ValidString(got) {
			t.Fatalf("%q cut %q inside a character", got, name)
		}
		if relayAppName(got) != got {
			t.Fatalf("not idempotent: %q then %q", got, relayAppName(got))
		}
		trimmed := strings.TrimSpace(name)
		if got == relayIdentity {
			if utf8.ValidString(name) && trimmed != "" && trimmed != relayIdentity {
				t.Fatalf("%q lost the operator's name %q", got, name)
			}
			return
		}
		if kept := strings.TrimSuffix(got, " ("+relayIdentity+")"); !strings.HasPrefix(trimmed, kept) {
			t.Fatalf("%q does not keep the start of the operator's name %q", got, name)
		}
	})
}

// Outages and producer-state hiccups must never count towards dead-lettering
// a message; only failures that are the message's own may.
func TestClassify(t *testing.T) {
	cases := map[failureKind][]error{
		failPermanent: {
			sarama.ErrMessageSizeTooLarge, sarama.ErrInvalidTopic, sarama.ErrTopicAuthorizationFailed,
			sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes"),
			&permanentError{&eventline.InvalidEventError{Field: "event_id", Reason: "missing"}},
		},
		failUnavailable: {
			sarama.ErrOutOfBrokers, sarama.ErrNotConnected, breaker.ErrBreakerOpen,
			sarama.ErrNotEnoughReplicas, sarama.ErrLeaderNotAvailable, sarama.ErrRequestTimedOut,
			sarama.ErrInvalidProducerEpoch, sarama.ErrOutOfOrderSequenceNumber, sarama.ErrUnknownProducerID,
			errFlushTimeout, context.DeadlineExceeded,
			&net.OpError{Op: "dial", Err: errors.New("connection refused")},
			io.EOF, io.ErrUnexpectedEOF, fmt.Errorf("wrapped: %w", io.EOF),
			fmt.Errorf("wrapped: %w", sarama.ErrOutOfBrokers),
			&missingTopicError{topic: "t", err: breaker.ErrBreakerOpen},
		},
		failRetry: {
			sarama.ErrUnknownTopicOrPartition, sarama.ErrUnknown, errors.New("something else"),
			&missingTopicError{topic: "t", err: sarama.ErrUnknownTopicOrPartition},
		},
	}
	for want, errs := range cases {
		for _, err := range errs {
			require.Equal(t, want, classify(err), "%v", err)
		}
	}
}

// While Kafka is unreachable a shard's wait doubles from Backoff.Initial
// up to 5 s, so it resumes within 5 s of Kafka's return. Before,
// the cap was 30 s: after a 20 s outage the relay caught up 7–13 s late
// (cmd/eventline/internal/e2e.TestKafkaOutageLosesNothing).
func TestUnavailableWaitDoublesUpToFiveSeconds(t *testing.T) {
	for _, c := range []struct {
		first time.Duration
		n     int
		want  time.Duration
	}{
		{time.Second, 1, time.Second},
		{time.Second, 2, 2 * time.Second},
		{time.Second, 3, 4 * time.Second},
		{time.Second, 4, 5 * time.Second},
		{time.Second, 1000, 5 * time.Second},
		{20 * time.Millisecond, 3, 80 * time.Millisecond},
		{time.Minute, 1, 5 * time.Second},
	} {
		if got := backoff.Delay(unavailableBackoff(eventline.Backoff{Initial: c.first}), c.n); got != c.want {
			t.Errorf("unavailable wait %d from %s = %s, want %s", c.n, c.first, got, c.want)
		}
	}
}

// A record Kafka refuses as too large (MESSAGE_TOO_LARGE) is at fault
// only if it was sent alone: Sarama batches records up to
// RelayConfig.MaxMessageBytes, and a topic whose max.message.bytes is
// smaller refuses a batch of records that each fit
// (cmd/eventline/internal/e2e.TestTopicLimitBelowTheRelaysDeadLettersOnlyTheTooLargeEvent
// dead-lettered 100 such records before). Sarama's own size check is about
// the record alone.
func TestClassifyItemTooLarge(t *testing.T) {
	tooLarge := &recordTooLargeError{topic: "t", recordBytes: 2000, topicLimit: 1024, relayLimit: DefaultMaxMessageBytes, err: sarama.ErrMessageSizeTooLarge}
	require.Equal(t, failBatchTooLarge, classifyItem(&item{err: tooLarge}))
	require.Equal(t, failBatchTooLarge, classifyItem(&item{err: sarama.ErrMessageSizeTooLarge}))
	require.Equal(t, failPermanent, classifyItem(&item{err: tooLarge, alone: true}))
	require.Equal(t, failPermanent, classifyItem(&item{err: sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes")}))
	require.Equal(t, failUnavailable, classifyItem(&item{err: sarama.ErrOutOfBrokers}))
	for _, s := range []string{`topic "t"`, "max.message.bytes, 1024 bytes", "RelayConfig.MaxMessageBytes (1048576 bytes)", "about 2000 bytes"} {
		require.Contains(t, tooLarge.Error(), s)
	}
}

// partitionOf returns the partition the relay's Kafka producer picks for
// key among n partitions, with cfg's partitioner.
func partitionOf(t *testing.T, cfg RelayConfig, key string, n int32) int32 {
	t.Helper()
	p := cfg.withDefaults().producerConfig().Producer.Partitioner("topic")
	got, err := p.Partition(&sarama.ProducerMessage{Topic: "topic", Key: sarama.StringEncoder(key)}, n)
	require.NoError(t, err)
	return got
}

// TestDefaultPartitionerMatchesKafkasJavaClient: by default the relay puts
// each key in the partition Kafka's Java client (DefaultPartitioner,
// Kafka Streams), franz-go and librdkafka's murmur2 partitioner choose:
// toPositive(murmur2(key)) % partitions.
func TestDefaultPartitionerMatchesKafkasJavaClient(t *testing.T) {
	cfg := RelayConfig{Brokers: []string{"localhost:9092"}}

	// Golden murmur2 values from Apache Kafka's UtilsTest.testMurmur2.
	for key, hash := range map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
	} {
		for _, n := range []int32{1, 3, 7, 12, 100, 1000} {
			want := (hash & 0x7fffffff) % n
			require.Equal(t, want, partitionOf(t, cfg, key, n), "key %q, %d partitions", key, n)
		}
	}
	// Partitions the Java client's DefaultPartitioner picks among 100
	// (published with Sarama's murmur2 partitioner).
	for key, want := range map[string]int32{"foo": 16, "bar": 45, "baz": 80, "kafka": 80, "sarama": 11} {
		require.Equal(t, want, partitionOf(t, cfg, key, 100), "key %q", key)
	}
	// And franz-go's default for keyed records agrees on any key.
	franz := kgo.StickyKeyPartitioner(nil).ForTopic("topic")
	for i := 0; i < 2000; i++ {
		key := "order-" + strconv.FormatUint(rand.Uint64(), 36)
		n := int32(1 + rand.IntN(64))
		want := franz.Partition(&kgo.Record{Key: []byte(key)}, int(n))
		require.EqualValues(t, want, partitionOf(t, cfg, key, n), "key %q, %d partitions", key, n)
	}
}

// TestFNV1aPartitionerKeepsTheOldMapping: deployments that relayed with
// Sarama's hash partitioner keep their key → partition mapping with
// PartitionerFNV1a.
func TestFNV1aPartitionerKeepsTheOldMapping(t *testing.T) {
	cfg := RelayConfig{Brokers: []string{"localhost:9092"}, Partitioner: PartitionerFNV1a}
	old := sarama.NewHashPartitioner("topic")
	for i := 0; i < 500; i++ {
		key := "agg-" + strconv.Itoa(i)
		want, err := old.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(key)}, 12)
		require.NoError(t, err)
		require.Equal(t, want, partitionOf(t, cfg, key, 12))
	}
}

func TestPartitionerIsValidated(t *testing.T) {
	err := RelayConfig{Brokers: []string{"localhost:9092"}, Partitioner: "crc32"}.withDefaults().validate()
	require.ErrorContains(t, err, "RelayConfig.Partitioner")
	err = RelayConfig{Brokers: []string{"localhost:9092"}, Partitioner: PartitionerSaramaConfig}.withDefaults().validate()
	require.ErrorContains(t, err, "RelayConfig.SaramaConfig")

	sc := sarama.NewConfig()
	sc.Producer.Partitioner = sarama.NewRoundRobinPartitioner
	cfg := RelayConfig{Brokers: []string{"localhost:9092"}, Partitioner: PartitionerSaramaConfig, SaramaConfig: sc}.withDefaults()
	require.NoError(t, cfg.validate())
	p := cfg.producerConfig().Producer.Partitioner("t")
	for want := int32(0); want < 3; want++ {
		got, err := p.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder("same")}, 3)
		require.NoError(t, err)
		require.Equal(t, want, got, "the configured round-robin partitioner is used")
	}

	// A SaramaConfig with Sarama's default partitioner still gets murmur2.
	cfg = RelayConfig{Brokers: []string{"localhost:9092"}, SaramaConfig: sarama.NewConfig()}.withDefaults()
	require.EqualValues(t, 16, partitionOf(t, cfg, "foo", 100))
}

// beforeTerminating is a query tracer that runs its hook once, as the
// first statement that terminates backends (pg_terminate_backend) starts.
type beforeTerminating struct {
	once sync.Once
	hook func()
}

func (b *beforeTerminating) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "pg_terminate_backend") {
		b.once.Do(b.hook)
	}
	return ctx
}

func (*beforeTerminating) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestClearingAFenceSparesASessionThatReleasedIt: a new owner's clearFence
// terminates a backend that holds the shard's read fence, and only while
// it holds it. The old owner may still run (a takeover under its feet):
// it commits, releasing the fence, just before the new owner's terminating
// statement starts, and its connection goes on to other work on the same
// backend (here another transaction). That session must live. Before the
// fix clearFence looked the holders up and terminated them in two round
// trips, and killed the session in between (SQLSTATE 57P01, seen in
// TestTakeoverWhileTheOwnerStillRuns). A session that keeps the fence is
// still ended, and counted in eventline_relay_stale_transactions_ended_total.
func TestClearingAFenceSparesASessionThatReleasedIt(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	const shard = 0

	// holder opens a session that takes the shard's read fence in a
	// transaction, as a relay's read does.
	holder := func() (*pgx.Conn, pgx.Tx) {
		conn, err := pgx.ConnectConfig(ctx, env.Pool.Config().ConnConfig.Copy())
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close(context.Background()) })
		tx, err := conn.Begin(ctx)
		require.NoError(t, err)
		var got bool
		require.NoError(t, tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1::int, $2::int)`,
			outbox.FenceNamespace(env.Schema), shard).Scan(&got))
		require.True(t, got, "the holder takes the fence")
		return conn, tx
	}
	hook := &beforeTerminating{hook: func() {}}
	cfg := env.Pool.Config().Copy()
	cfg.ConnConfig.Tracer = hook
	cfg.MaxConns = PoolSizeFor(1)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	reg := prometheus.NewRegistry()
	metrics, err := NewRelayMetrics(reg)
	require.NoError(t, err)
	var logs strings.Builder
	r, err := NewRelay(ctx, pool, RelayConfig{Schema: env.Schema, Brokers: []string{"127.0.0.1:1"}, Metrics: metrics,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	require.NoError(t, err)
	s := &shardRunner{relay: r, shard: shard, log: r.log.With("shard", shard), sql: newShardSQL(env.Schema, shard)}
	cleared := func() float64 {
		return metrictest.Sum(t, reg, "eventline_relay_stale_transactions_ended_total")
	}

	// The old owner commits just before the new owner terminates, and its
	// session begins other work.
	conn, tx := holder()
	hook.hook = func() {
		require.NoError(t, tx.Commit(ctx))
		var err error
		tx, err = conn.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `SELECT 1`)
		require.NoError(t, err)
	}
	s.clearFence(ctx)
	var one int
	require.NoError(t, tx.QueryRow(ctx, `SELECT 1`).Scan(&one),
		"the session released the fence before clearFence terminated: it must be spared")
	require.NoError(t, tx.Commit(ctx))
	require.Zero(t, cleared())
	require.NotContains(t, logs.String(), "ended a previous owner's stale transaction")

	// A session that keeps the fence is ended, and the fence is free.
	conn, tx = holder()
	pid := conn.PgConn().PID()
	s.clearFence(ctx)
	err = tx.QueryRow(ctx, `SELECT 1`).Scan(&one)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "57P01" {
		require.True(t, conn.IsClosed(), "the fence holder must be terminated, got %v", err)
	}
	require.Equal(t, 1.0, cleared())
	require.Contains(t, logs.String(), "ended a previous owner's stale transaction")
	require.Contains(t, logs.String(), "pid="+strconv.Itoa(int(pid)))
	free, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = free.Rollback(ctx) }()
	var got bool
	require.NoError(t, free.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1::int, $2::int)`,
		outbox.FenceNamespace(env.Schema), shard).Scan(&got))
	require.True(t, got, "the fence is free once its holder is ended")
}
