package producer_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

func newProducer(t *testing.T, env pgtest.Env) *producer.Producer {
	t.Helper()
	p, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: "orders"})
	require.NoError(t, err)
	return p
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

func TestPublishTxRejectsBadInputBeforeSQL(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
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
			tx, err := env.Pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx)

			bad := good
			c.mutate(&bad)
			err = p.PublishTx(ctx, tx, good, bad)
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
	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
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

func TestNewRequiresMigratedSchema(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	_, err := producer.New(context.Background(), pool, producer.Config{Schema: "no_such_schema_x"})
	require.True(t, errors.Is(err, producer.ErrNotMigrated), "got %v", err)
	_, err = producer.New(context.Background(), pool, producer.Config{Schema: "bad-schema"})
	require.ErrorContains(t, err, "producer.Config.Schema")
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

// A nil pool, untyped or a nil *pgxpool.Pool, is refused by New; before,
// New panicked on it.
func TestNewRefusesANilPool(t *testing.T) {
	var pool *pgxpool.Pool
	for _, db := range []admin.DBTX{nil, pool} {
		_, err := producer.New(context.Background(), db, producer.Config{})
		require.ErrorContains(t, err, "db is nil")
	}
}
