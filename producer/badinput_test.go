package producer_test

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/producer"
)

// TestPublishRefusesANilHandle: Publish with a nil db (untyped, or a nil
// *pgxpool.Pool in the interface) and PublishTx with a nil *pgxpool.Tx
// return an error saying what to pass, instead of panicking.
func TestPublishRefusesANilHandle(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx := context.Background()

	var nilPool *pgxpool.Pool
	require.ErrorContains(t, p.Publish(ctx, nil, orderEvent(t, "a")), "producer.Publish: db is nil")
	require.ErrorContains(t, p.Publish(ctx, nilPool, orderEvent(t, "a")), "producer.Publish: db is nil")

	var nilTx *pgxpool.Tx
	require.ErrorContains(t, p.PublishTx(ctx, nilTx, orderEvent(t, "a")), "needs a transaction")
	var nilIface pgx.Tx
	_, err := p.PublishTxReturning(ctx, nilIface, orderEvent(t, "a"))
	require.ErrorContains(t, err, "needs a transaction")
	require.Zero(t, outboxCount(t, env))
}

// TestNewRelayRefusesValuesThatBreakAtRunTime: settings NewRelay used to
// accept and Run then could not use are refused, naming the field. A
// RebalanceInterval of a week gave PostgreSQL a tcp_user_timeout beyond
// its int range, so Run never configured its sessions and relayed nothing
// (logging at debug level only); an ID with a NUL byte could never own a
// lease; a NaN MaxPublishRate silently meant "no cap"; a PollInterval near
// the Duration limit overflowed the wait mark's TTL.
func TestNewRelayRefusesValuesThatBreakAtRunTime(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	for field, cfg := range map[string]producer.RelayConfig{
		"RelayConfig.RebalanceInterval": {RebalanceInterval: 7 * 24 * time.Hour},
		"RelayConfig.PollInterval":      {PollInterval: math.MaxInt64},
		"RelayConfig.MaxPublishRate":    {MaxPublishRate: math.NaN()},
		"RelayConfig.ID":                {ID: "relay\x00one"},
		"RelayConfig.ID ":               {ID: "relay-\xff"},
		"RelayConfig.MaxMessageBytes":   {MaxMessageBytes: int(sarama.MaxRequestSize)}, // Sarama ignored it
		"RelayConfig.MaxMessageBytes ":  {MaxMessageBytes: 10},
	} {
		cfg.Schema, cfg.Brokers, cfg.Logger = env.Schema, []string{"localhost:9092"}, relaytest.Logger(t)
		_, err := producer.NewRelay(context.Background(), env.Pool, cfg)
		require.ErrorContains(t, err, strings.TrimSpace(field))
	}
}

// TestRelayRunsAtTheLongestRebalanceInterval: the bound is on the right
// side of PostgreSQL's limits: a relay at the longest RebalanceInterval
// (and PollInterval) configures its sessions and takes its shards.
func TestRelayRunsAtTheLongestRebalanceInterval(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	brokers := kafkatest.Brokers(t)
	r, _ := relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, RebalanceInterval: 24 * time.Hour, PollInterval: 24 * time.Hour})
	require.Eventually(t, func() bool { return len(producer.OwnedShards(r)) == env.Shards }, 30*time.Second, 20*time.Millisecond,
		"the relay never took its shards")
	_, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{
		Schema: env.Schema, Brokers: brokers, RebalanceInterval: 24*time.Hour + 1,
	})
	require.ErrorContains(t, err, "RelayConfig.RebalanceInterval must be between 10ms and 24h0m0s")
}

// TestNewRelayConfigProperty draws relay configurations with zero,
// negative, tiny and huge durations and sizes, NaN and infinite rates and
// odd strings. NewRelay never panics, and either accepts the configuration
// or names, in its error, every field the draw made invalid; a refused
// configuration starts nothing.
func TestNewRelayConfigProperty(t *testing.T) {
	env := pgtest.New(t, pgtest.Options{})
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	durations := []time.Duration{0, -1, -time.Hour, math.MinInt64, 1, 9 * time.Millisecond, 10 * time.Millisecond, time.Second,
		24 * time.Hour, 24*time.Hour + 1, 1000 * time.Hour, math.MaxInt64}
	validInterval := func(d time.Duration) bool { return d == 0 || (d >= 10*time.Millisecond && d <= 24*time.Hour) }
	rapid.Check(t, func(rt *rapid.T) {
		var cfg producer.RelayConfig
		cfg.Schema = env.Schema
		cfg.Brokers = []string{"localhost:9092"}
		cfg.Logger = relaytest.Logger(t)
		bad := map[string]bool{}

		cfg.PollInterval = rapid.SampledFrom(durations).Draw(rt, "poll")
		bad["PollInterval"] = !validInterval(cfg.PollInterval)
		cfg.RebalanceInterval = rapid.SampledFrom(durations).Draw(rt, "rebalance")
		bad["RebalanceInterval"] = !validInterval(cfg.RebalanceInterval)
		cfg.RetentionWindow = rapid.SampledFrom(durations).Draw(rt, "retention")
		bad["RetentionWindow"] = cfg.RetentionWindow < 0
		cfg.CleanupInterval = rapid.SampledFrom(durations).Draw(rt, "cleanup") // negative disables cleanup
		cfg.BatchSize = rapid.SampledFrom([]int{0, -1, 1, 100_000, 100_001, math.MaxInt, math.MinInt}).Draw(rt, "batch")
		bad["BatchSize"] = cfg.BatchSize != 0 && (cfg.BatchSize < 1 || cfg.BatchSize > 100_000)
		cfg.MaxAttempts = rapid.SampledFrom([]int{0, -1, 1, math.MaxInt, math.MinInt}).Draw(rt, "attempts")
		bad["MaxAttempts"] = cfg.MaxAttempts < 0
		cfg.CleanupBatchSize = rapid.SampledFrom([]int{0, -1, 1, math.MaxInt}).Draw(rt, "cleanupBatch")
		bad["CleanupBatchSize"] = cfg.CleanupBatchSize < 0
		cfg.MaxMessageBytes = rapid.SampledFrom([]int{0, -1, 1, 1 << 20, math.MinInt}).Draw(rt, "maxBytes")
		bad["MaxMessageBytes"] = cfg.MaxMessageBytes < 0
		cfg.MaxPublishRate = rapid.SampledFrom([]float64{0, -1, 0.5, 1e300, math.Inf(1), math.Inf(-1), math.NaN()}).Draw(rt, "rate")
		bad["MaxPublishRate"] = cfg.MaxPublishRate < 0 || math.IsNaN(cfg.MaxPublishRate)
		switch rapid.IntRange(0, 3).Draw(rt, "backoff") {
		case 1:
			cfg.Backoff = eventline.Backoff{Initial: -time.Second}
			bad["Backoff"] = true
		case 2:
			cfg.Backoff = eventline.Backoff{Initial: time.Second, Max: time.Millisecond, Multiplier: math.NaN()}
			bad["Backoff"] = true
		case 3:
			cfg.Backoff = eventline.Backoff{Max: math.MaxInt64}
		}
		cfg.ID = rapid.SampledFrom([]string{"", " ", "relay-1", "é", "a\x00b", "\xff", strings.Repeat("r", 10_000)}).Draw(rt, "id")
		bad["ID"] = strings.ContainsRune(cfg.ID, 0) || cfg.ID == "\xff"
		cfg.Partitioner = producer.Partitioner(rapid.SampledFrom([]string{"", "murmur2", "fnv1a", "sarama-config", "MURMUR2", " "}).Draw(rt, "partitioner"))
		bad["Partitioner"] = cfg.Partitioner != "" && cfg.Partitioner != producer.PartitionerMurmur2 && cfg.Partitioner != producer.PartitionerFNV1a // sarama-config needs a SaramaConfig
		switch rapid.IntRange(0, 2).Draw(rt, "brokers") {
		case 1:
			cfg.Brokers = []string{""}
			bad["Brokers"] = true
		case 2:
			cfg.Brokers = []string{"localhost:9092", "no-port"}
			bad["Brokers"] = true
		}
		cfg.Schema = rapid.SampledFrom([]string{env.Schema, env.Schema, `x"; drop table y; --`, "pg_x", strings.Repeat("s", 64)}).Draw(rt, "schema")
		bad["Schema"] = cfg.Schema != env.Schema

		r, err := producer.NewRelay(context.Background(), env.Pool, cfg)
		invalid := false
		for field, b := range bad {
			if !b {
				continue
			}
			invalid = true
			require.ErrorContains(rt, err, "RelayConfig."+field)
		}
		if !invalid {
			require.NoError(rt, err)
			require.NotNil(rt, r)
		}
	})
}

// TestPublishTxRefusesAnIDTwiceInOneCall: two events of one call with the
// same id were both written; every consumer then applied the first and
// dead-lettered the second as an id conflict. The call is refused before
// any SQL, naming the field and both events.
func TestPublishTxRefusesAnIDTwiceInOneCall(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx := context.Background()

	a, b := orderEvent(t, "a"), orderEvent(t, "b")
	a.ID = eventline.NewEventID()
	b.ID = a.ID
	err := p.Publish(ctx, env.Pool, a, orderEvent(t, "c"), b)
	var ie *eventline.InvalidEventError
	require.ErrorAs(t, err, &ie)
	require.Equal(t, eventline.MetaEventID, ie.Field)
	require.ErrorContains(t, err, "event 2: ")
	require.ErrorContains(t, err, "event 0 of the same call has it too")
	require.Zero(t, outboxCount(t, env))

	b.ID = ""
	require.NoError(t, p.Publish(ctx, env.Pool, a, b))
	require.Equal(t, 2, outboxCount(t, env))
}

// TestPublishTxRefusesAVersionPastTheLargest: an event left to follow a
// supplied version math.MaxInt64 in the same call overflowed to a negative
// version, and PostgreSQL refused the row with a check-constraint error
// that aborted the caller's transaction. The call is refused before any
// SQL, naming the field, and tx stays usable.
func TestPublishTxRefusesAVersionPastTheLargest(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducerWith(t, env, producer.Config{AllowVersionGaps: true})
	ctx := context.Background()

	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	err = p.PublishTx(ctx, tx, versioned(t, "a", math.MaxInt64-1), orderEvent(t, "a"), orderEvent(t, "a"))
	var ie *eventline.InvalidEventError
	require.ErrorAs(t, err, &ie)
	require.Equal(t, eventline.MetaAggregateVersion, ie.Field)
	require.ErrorContains(t, err, "event 2: ")
	require.NoError(t, p.PublishTx(ctx, tx, versioned(t, "a", math.MaxInt64-1), orderEvent(t, "a")), "tx is still usable")
	require.NoError(t, tx.Commit(ctx))
}

// TestNewRelayValidatesTheSaramaConfig: a SaramaConfig Sarama refuses
// (after the relay enforced its own settings on it) passed NewRelay, and
// Run then logged "Kafka unreachable; retrying" for ever. NewRelay refuses
// it, naming the field and Sarama's reason.
func TestNewRelayValidatesTheSaramaConfig(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	sc := sarama.NewConfig()
	sc.Net.DialTimeout = 0
	_, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{
		Schema: env.Schema, Brokers: []string{"localhost:9092"}, SaramaConfig: sc, Logger: relaytest.Logger(t)})
	require.ErrorContains(t, err, "RelayConfig.SaramaConfig: kafka: invalid configuration (Net.DialTimeout must be > 0)")

	// What the relay enforces (idempotence, acks, one request in flight)
	// is not held against the caller's config.
	sc = sarama.NewConfig()
	sc.Producer.RequiredAcks = sarama.NoResponse
	sc.Net.MaxOpenRequests = 5
	_, err = producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{
		Schema: env.Schema, Brokers: []string{"localhost:9092"}, SaramaConfig: sc, Logger: relaytest.Logger(t)})
	require.NoError(t, err)
}
