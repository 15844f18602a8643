package producer_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

func newProducer(t *testing.T, env pgtest.Env) *producer.Producer {
	t.Helper()
	return newProducerWith(t, env, producer.Config{})
}

// outboxCount counts rows across every shard table.
func outboxCount(t *testing.T, env pgtest.Env) int {
	t.Helper()
	total := 0
	for s := 0; s < env.Shards; s++ {
		total += pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, outbox.Table(s)))
	}
	return total
}

func orderEvent(t *testing.T, id string) eventline.Event {
	e, err := eventline.NewJSONEvent("order.created", "order", id, map[string]any{"order_id": id})
	require.NoError(t, err)
	return e
}

func TestPublishTxCommitsAndRollsBackWithCallerTx(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx := context.Background()

	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, p.PublishTx(ctx, tx, orderEvent(t, "1")))
	// Not visible outside the transaction before commit.
	require.Equal(t, 0, outboxCount(t, env))
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 0, outboxCount(t, env), "rolled-back event must not exist")

	tx, err = env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, p.PublishTx(ctx, tx, orderEvent(t, "2")))
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, outboxCount(t, env), "committed event must exist")

	// The row lands in the aggregate's shard, as a forwarder envelope for
	// the default topic carrying the envelope metadata.
	shard := outbox.ShardFor("order", "2", env.Shards)
	var payload []byte
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT payload FROM `+sqlident.Qualify(env.Schema, outbox.Table(shard))).Scan(&payload))
	var envelope struct {
		DestinationTopic string            `json:"destination_topic"`
		UUID             string            `json:"uuid"`
		Metadata         map[string]string `json:"metadata"`
	}
	require.NoError(t, json.Unmarshal(payload, &envelope))
	require.Equal(t, "orders", envelope.DestinationTopic)
	require.Equal(t, envelope.UUID, envelope.Metadata[eventline.MetaEventID])
	require.Equal(t, "1", envelope.Metadata[eventline.MetaAggregateVersion])
	require.Equal(t, "2", envelope.Metadata[eventline.MetaAggregateID])
}

// TestPublishTxRefusesBeforeSQL: what PublishTx cannot write is refused
// before any SQL runs, with an error that names it, and the caller's
// transaction stays usable.
func TestPublishTxRefusesBeforeSQL(t *testing.T) {
	t.Parallel()
	// setup returns a schema of the subtest's own and a producer on it.
	setup := func(t *testing.T, cfg producer.Config) (pgtest.Env, *producer.Producer) {
		t.Parallel()
		env := pgtest.New(t, pgtest.Options{})
		return env, newProducerWith(t, env, cfg)
	}

	t.Run("bad input", func(t *testing.T) {
		env, p := setup(t, producer.Config{})
		ctx := context.Background()

		good := orderEvent(t, "1")
		cases := map[string]struct {
			mutate func(*eventline.Event)
			field  string
		}{
			"empty aggregate id":     {func(e *eventline.Event) { e.AggregateID = "" }, "aggregate_id"},
			"empty aggregate type":   {func(e *eventline.Event) { e.AggregateType = " " }, "aggregate_type"},
			"empty type":             {func(e *eventline.Event) { e.Type = "" }, "event_type"},
			"bad topic":              {func(e *eventline.Event) { e.Topic = "orders; DROP TABLE x" }, "topic"},
			"invalid json":           {func(e *eventline.Event) { e.Payload = []byte(`{"a":`) }, "payload"},
			"reserved metadata":      {func(e *eventline.Event) { e.Metadata = map[string]string{"event_id": "x"} }, "metadata"},
			"negative version":       {func(e *eventline.Event) { e.AggregateVersion = -1 }, "aggregate_version"},
			"occurred in year 99999": {func(e *eventline.Event) { e.OccurredAt = time.Date(99999, 1, 1, 0, 0, 0, 0, time.UTC) }, "occurred_at"},
		}
		for name, c := range cases {
			t.Run(name, func(t *testing.T) {
				tx := mustTx(t, env)

				bad := good
				c.mutate(&bad)
				err := p.PublishTx(ctx, tx, good, bad)
				require.ErrorIs(t, err, eventline.ErrInvalidEvent)
				var ie *eventline.InvalidEventError
				require.ErrorAs(t, err, &ie)
				require.Equal(t, c.field, ie.Field)

				// The transaction is still usable: nothing ran.
				var one int
				require.NoError(t, tx.QueryRow(ctx, `SELECT 1`).Scan(&one))
				require.NoError(t, p.PublishTx(ctx, tx, good))
			})
		}

		// Non-JSON payloads are fine when declared as such.
		raw := good
		raw.ContentType = "application/octet-stream"
		raw.Payload = []byte{0xff, 0x00, 0x01}
		require.NoError(t, p.Publish(ctx, env.Pool, raw))
	})

	// Publish with a nil db (untyped, or a nil *pgxpool.Pool in the interface)
	// and PublishTx with a nil *pgxpool.Tx return an error saying what to pass,
	// instead of panicking.
	t.Run("a nil handle", func(t *testing.T) {
		env, p := setup(t, producer.Config{})
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
	})

	// Two events of one call with the same id were both written; every consumer
	// then applied the first and dead-lettered the second as an id conflict.
	// The call is refused before any SQL, naming the field and both events.
	t.Run("an id twice in one call", func(t *testing.T) {
		env, p := setup(t, producer.Config{})
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
	})

	// An event left to follow a supplied version math.MaxInt64 in the same call
	// overflowed to a negative version, and PostgreSQL refused the row with a
	// check-constraint error that aborted the caller's transaction. The call is
	// refused before any SQL, naming the field, and tx stays usable.
	t.Run("a version past the largest", func(t *testing.T) {
		env, p := setup(t, producer.Config{AllowVersionGaps: true})
		ctx := context.Background()

		tx := mustTx(t, env)
		err := p.PublishTx(ctx, tx, versioned(t, "a", math.MaxInt64-1), orderEvent(t, "a"), orderEvent(t, "a"))
		var ie *eventline.InvalidEventError
		require.ErrorAs(t, err, &ie)
		require.Equal(t, eventline.MetaAggregateVersion, ie.Field)
		require.ErrorContains(t, err, "event 2: ")
		require.NoError(t, p.PublishTx(ctx, tx, versioned(t, "a", math.MaxInt64-1), orderEvent(t, "a")), "tx is still usable")
		require.NoError(t, tx.Commit(ctx))
	})

	// An event whose Kafka record would exceed MaxMessageBytes is refused
	// before any SQL (here, in a transaction that has already ended, any
	// statement would fail), with the size and the limit.
	t.Run("an oversize event", func(t *testing.T) {
		env, p := setup(t, producer.Config{})
		ctx := context.Background()

		big := orderEvent(t, "a")
		big.Payload = []byte(`"` + strings.Repeat("x", 2<<20) + `"`) // 2 MiB of JSON
		err := p.PublishTx(ctx, closedTx(t, env), orderEvent(t, "b"), big)
		require.ErrorIs(t, err, producer.ErrEventTooLarge)
		var tooLarge *producer.EventTooLargeError
		require.ErrorAs(t, err, &tooLarge)
		require.Equal(t, 1, tooLarge.Index)
		require.Equal(t, producer.DefaultMaxMessageBytes, tooLarge.Limit)
		require.Greater(t, tooLarge.Size, 2<<20)
		require.ErrorContains(t, err, "MaxMessageBytes")

		tx := mustTx(t, env)
		require.ErrorIs(t, p.PublishTx(ctx, tx, orderEvent(t, "b"), big), producer.ErrEventTooLarge)
		requireUsable(t, tx)
		require.NoError(t, tx.Commit(ctx))
		require.Zero(t, outboxCount(t, env))
	})

	// NUL bytes and invalid UTF-8 in metadata keys or values can neither be
	// stored byte-exact by consumers nor travel as they are; they are refused
	// before any SQL.
	t.Run("unstorable metadata", func(t *testing.T) {
		env, p := setup(t, producer.Config{})
		for name, md := range map[string]map[string]string{
			"NUL in value":        {"tenant": "a\x00b"},
			"NUL in key":          {"ten\x00ant": "acme"},
			"invalid UTF-8 value": {"tenant": "a\xffb"},
			"invalid UTF-8 key":   {"ten\xc3ant": "acme"},
			"reserved key":        {"traceparent": "00-x"},
		} {
			e := orderEvent(t, "a")
			e.Metadata = md
			err := p.PublishTx(context.Background(), closedTx(t, env), e)
			require.ErrorIs(t, err, eventline.ErrInvalidEvent, name)
			var ie *eventline.InvalidEventError
			require.ErrorAs(t, err, &ie, name)
			require.Equal(t, "metadata", ie.Field, name)
		}
		// NUL in the envelope's own text fields too.
		e := orderEvent(t, "a")
		e.CorrelationID = "x\x00"
		require.ErrorIs(t, p.PublishTx(context.Background(), closedTx(t, env), e), eventline.ErrInvalidEvent)
	})
}

func TestPublishTxAssignsAndChecksVersions(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx := context.Background()

	// Two events of one aggregate and one of another in one call.
	a1, a2, b1 := orderEvent(t, "a"), orderEvent(t, "a"), orderEvent(t, "b")
	require.NoError(t, p.Publish(ctx, env.Pool, a1, b1, a2))
	require.Equal(t, []int64{1, 2}, versionsOf(t, env, "a"))
	require.Equal(t, []int64{1}, versionsOf(t, env, "b"))

	// The events as written carry what the producer filled in.
	tx0 := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx0, orderEvent(t, "b"))
	require.NoError(t, err)
	require.EqualValues(t, 2, written[0].AggregateVersion)
	require.NotEmpty(t, written[0].ID)
	require.Equal(t, "orders", written[0].Topic)
	require.NoError(t, tx0.Rollback(ctx)) // it holds b's sequence row until it ends

	// A supplied version that is the next one is accepted and advances the
	// sequence; the next automatic version follows it.
	s := orderEvent(t, "a")
	s.AggregateVersion = 3
	require.NoError(t, p.Publish(ctx, env.Pool, s, orderEvent(t, "a")))
	s = orderEvent(t, "a")
	s.AggregateVersion = 5
	require.NoError(t, p.Publish(ctx, env.Pool, s, orderEvent(t, "a")))
	require.Equal(t, []int64{1, 2, 3, 4, 5, 6}, versionsOf(t, env, "a"))

	// A supplied version that is not greater fails with the numbers, and
	// leaves the transaction usable with nothing written.
	tx := mustTx(t, env)
	stale := orderEvent(t, "a")
	stale.AggregateVersion = 6
	err = p.PublishTx(ctx, tx, orderEvent(t, "b"), stale)
	var vc *producer.VersionConflictError
	require.ErrorAs(t, err, &vc)
	require.ErrorIs(t, err, producer.ErrVersionConflict)
	require.Equal(t, int64(6), vc.Version)
	require.Equal(t, int64(6), vc.Current)
	require.NoError(t, p.PublishTx(ctx, tx, orderEvent(t, "b")))
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []int64{1, 2}, versionsOf(t, env, "b"), "the conflicting call must not have consumed b's version 2 (the returning call was rolled back)")
}

func TestPublishTxConcurrentWritersGetDistinctVersions(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 8})
	p := newProducer(t, env)
	ctx := context.Background()

	const writers, each = 8, 20
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
					return p.PublishTx(ctx, tx, orderEvent(t, "hot"), orderEvent(t, "hot"))
				})
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	got := versionsOf(t, env, "hot")
	// Outbox order is xid order, which may differ from version order (see
	// the relay's ordering notes); the versions themselves must be 1..n.
	slices.Sort(got)
	require.Len(t, got, writers*each*2)
	for i, v := range got {
		require.Equal(t, int64(i+1), v)
	}
}

// versionsOf returns the aggregate versions of an order's events in outbox
// order.
func versionsOf(t *testing.T, env pgtest.Env, id string) []int64 {
	t.Helper()
	shard := outbox.ShardFor("order", id, env.Shards)
	rows, err := env.Pool.Query(context.Background(), `SELECT (payload->'metadata'->>'aggregate_version')::bigint FROM `+
		sqlident.Qualify(env.Schema, outbox.Table(shard))+` WHERE payload->'metadata'->>'aggregate_id' = $1 ORDER BY transaction_id, "offset"`, id)
	require.NoError(t, err)
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	return vs
}

// mustTx begins a transaction that is rolled back when the test ends.
func mustTx(t *testing.T, env pgtest.Env) pgx.Tx {
	t.Helper()
	tx, err := env.Pool.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// closedTx returns a transaction that has already ended: any statement run
// in it fails, so a call that returns its own error with it ran no SQL.
func closedTx(t *testing.T, env pgtest.Env) pgx.Tx {
	t.Helper()
	tx, err := env.Pool.Begin(context.Background())
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(context.Background()))
	return tx
}

// requireUsable checks that tx can still run statements.
func requireUsable(t require.TestingT, tx pgx.Tx) {
	var one int
	require.NoError(t, tx.QueryRow(context.Background(), `SELECT 1`).Scan(&one), "the transaction must still be usable")
}

// storedEvent reads back the event with this id from the outbox, as the
// relay will send it, and the raw envelope metadata.
func storedEvent(t *testing.T, env pgtest.Env, id string) (eventline.Event, map[string]string) {
	t.Helper()
	rows := rowsOf(t, env, id)
	require.Len(t, rows, 1, "event %s must be stored once", id)
	var envelope struct {
		UUID     string            `json:"uuid"`
		Payload  []byte            `json:"payload"`
		Metadata map[string]string `json:"metadata"`
	}
	require.NoError(t, json.Unmarshal([]byte(rows[0].payload), &envelope))
	msg := message.NewMessage(envelope.UUID, envelope.Payload)
	msg.Metadata = envelope.Metadata
	e, err := eventline.Decode(msg)
	require.NoError(t, err)
	return e, envelope.Metadata
}

// sequence returns an aggregate's recorded last version and topic; ok is
// false when it has no sequence row.
func sequence(t require.TestingT, env pgtest.Env, typ, id string) (version int64, topic *string, ok bool) {
	err := env.Pool.QueryRow(context.Background(), `SELECT version, topic FROM `+sqlident.Qualify(env.Schema, "aggregate_sequences")+
		` WHERE aggregate_type = $1 AND aggregate_id = $2`, typ, id).Scan(&version, &topic)
	if err == pgx.ErrNoRows {
		return 0, nil, false
	}
	require.NoError(t, err)
	return version, topic, true
}

// newProducerWith is producer.New with cfg on env's schema, DefaultTopic
// "orders" unless cfg sets one.
func newProducerWith(t *testing.T, env pgtest.Env, cfg producer.Config) *producer.Producer {
	t.Helper()
	cfg.Schema = env.Schema
	cfg.DefaultTopic = cmp.Or(cfg.DefaultTopic, "orders")
	p, err := producer.New(context.Background(), env.Pool, cfg)
	require.NoError(t, err)
	return p
}

// versioned returns an order event for aggregate id with a supplied
// version.
func versioned(t *testing.T, id string, version int64) eventline.Event {
	e := orderEvent(t, id)
	e.AggregateVersion = version
	return e
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

// TestTheProducerDoesNotLinkTheConsumer keeps the writing half free of the
// reading half: a service that only publishes links none of the consumer's
// packages. (watermill-sql's own import of Watermill's router middleware
// is not eventline's.)
func TestTheProducerDoesNotLinkTheConsumer(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	out, err := exec.Command("go", "list", "-deps", "github.com/eventline/eventline/producer").CombinedOutput()
	require.NoError(t, err, "go list: %s", out)
	for _, dep := range strings.Fields(string(out)) {
		for _, consumerSide := range []string{"middleware", "versioning", "dedup", "consumer"} {
			require.NotEqual(t, "github.com/eventline/eventline/"+consumerSide, dep)
		}
	}
}

// TestNewRelayRefusesBadConfig: NewRelay refuses what Run could not use,
// naming the field, before anything starts.
func TestNewRelayRefusesBadConfig(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})

	t.Run("names every invalid field", func(t *testing.T) {
		_, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{
			Schema: env.Schema, Brokers: []string{"nohostport"}, BatchSize: -1, Backoff: eventline.Backoff{Initial: -time.Second},
		})
		require.Error(t, err)
		for _, field := range []string{"RelayConfig.Brokers", "RelayConfig.BatchSize", "RelayConfig.Backoff"} {
			require.ErrorContains(t, err, field)
		}
		_, err = producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{Schema: "missing_schema", Brokers: []string{"localhost:9092"}})
		require.ErrorIs(t, err, producer.ErrNotMigrated)
	})

	// Settings NewRelay used to accept and Run then could not use. A
	// RebalanceInterval of a week gave PostgreSQL a tcp_user_timeout beyond its
	// int range, so Run never configured its sessions and relayed nothing
	// (logging at debug level only); an ID with a NUL byte could never own a
	// lease; a NaN MaxPublishRate silently meant "no cap"; a PollInterval near
	// the Duration limit overflowed the wait mark's TTL.
	t.Run("values that break at run time", func(t *testing.T) {
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
	})

	// A SaramaConfig Sarama refuses (after the relay enforced its own settings
	// on it) passed NewRelay, and Run then logged "Kafka unreachable; retrying"
	// for ever. The error names Sarama's reason.
	t.Run("a SaramaConfig Sarama refuses", func(t *testing.T) {
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
	})

	// A relay needs one connection per shard plus three; a smaller pool would
	// silently serialize shard reads.
	t.Run("a small pool", func(t *testing.T) {
		env := pgtest.New(t, pgtest.Options{Shards: 8, MaxConns: 4})
		_, err := producer.NewRelay(context.Background(), env.Pool, producer.RelayConfig{Schema: env.Schema, Brokers: []string{"localhost:9092"}})
		require.Error(t, err)
		require.True(t, errors.Is(err, producer.ErrPoolTooSmall), "got %v", err)
		require.ErrorContains(t, err, "needs 11")
		require.EqualValues(t, 11, producer.PoolSizeFor(8))

		big := pgtest.Pool(t, producer.PoolSizeFor(8))
		_, err = producer.NewRelay(context.Background(), big, producer.RelayConfig{Schema: env.Schema, Brokers: []string{"localhost:9092"}})
		require.NoError(t, err)
	})
}

// TestNewRefusesBadArguments: New refuses a nil pool (before, it panicked
// on one), a schema that is not migrated or not an identifier, and limits
// or schema versions it cannot use, naming the field.
func TestNewRefusesBadArguments(t *testing.T) {
	t.Parallel()
	t.Run("a nil pool", func(t *testing.T) {
		var pool *pgxpool.Pool
		for _, db := range []admin.DBTX{nil, pool} {
			_, err := producer.New(context.Background(), db, producer.Config{})
			require.ErrorContains(t, err, "db is nil")
		}
	})
	t.Run("an unmigrated or invalid schema", func(t *testing.T) {
		pool := pgtest.Pool(t, 2)
		_, err := producer.New(context.Background(), pool, producer.Config{Schema: "no_such_schema_x"})
		require.True(t, errors.Is(err, producer.ErrNotMigrated), "got %v", err)
		_, err = producer.New(context.Background(), pool, producer.Config{Schema: "bad-schema"})
		require.ErrorContains(t, err, "producer.Config.Schema")
	})
	t.Run("limits and schema versions", func(t *testing.T) {
		env := pgtest.New(t, pgtest.Options{})
		for field, cfg := range map[string]producer.Config{
			"producer.Config.MaxMessageBytes": {MaxMessageBytes: -1},
			"producer.Config.SchemaVersions":  {SchemaVersions: map[string]int{"order.created": 0}},
		} {
			cfg.Schema = env.Schema
			_, err := producer.New(context.Background(), env.Pool, cfg)
			require.ErrorContains(t, err, field)
		}
		_, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, MaxMessageBytes: 200 << 20})
		require.ErrorContains(t, err, "producer.Config.MaxMessageBytes")
	})
}
