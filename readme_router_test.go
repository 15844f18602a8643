package eventline_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/eventline/eventline"
	elkafkatest "github.com/eventline/eventline/eventlinetest/kafkatest"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/migrations"
)

// TestReadmeOwnRouterLetsOtherEventTypesPass runs the README's own-Router
// snippet (readmeOwnRouter) as a reader would: on a topic that carries
// every event type of the order aggregate, here an order.created and then
// an order.paid, as the README's producer writes them. Unlike the ready
// runner, which dispatches on the event type, the Router hands the snippet's
// handler every event of the topic: the order.paid must pass (applied as a
// no-op), not be decoded as an OrderCreated, fail on the duplicate invoice
// through its retries and be dead-lettered.
func TestReadmeOwnRouterLetsOtherEventTypesPass(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the README's Router against PostgreSQL and in-process Kafka")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := ownDatabase(t) // the snippet uses the default schema, "eventline"
	require.NoError(t, migrations.Up(ctx, pool, migrations.Config{Schema: "eventline", Shards: 1}))
	_, err := pool.Exec(ctx, `CREATE TABLE invoices (order_id text PRIMARY KEY, amount_cents bigint NOT NULL, late bool NOT NULL)`)
	require.NoError(t, err)

	_, brokers := kafkatest.Fake(t, kfake.SeedTopics(1, "orders")) // never a shared cluster: the snippet's topic is "orders"
	created, err := eventline.NewJSONEvent("order.created", "order", "o-1", OrderCreated{ID: "o-1", AmountCents: 1250})
	require.NoError(t, err)
	created.AggregateVersion = 1
	paid, err := eventline.NewJSONEvent("order.paid", "order", "o-1", map[string]string{"id": "o-1"})
	require.NoError(t, err)
	paid.AggregateVersion = 2
	require.NoError(t, elkafkatest.Publish(ctx, brokers, "orders", created, paid))

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- readmeOwnRouter(runCtx, pool, brokers) }()
	settled := func() int {
		return pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM eventline.processed_events WHERE consumer_group = 'billing')
			+ (SELECT count(*) FROM eventline.held_events WHERE kind = 'dead_letter')`)
	}
	require.Eventually(t, func() bool { return settled() >= 2 }, 45*time.Second, 50*time.Millisecond,
		"both events applied or dead-lettered")
	stop()
	require.NoError(t, <-done)

	var reasons []string
	rows, err := pool.Query(ctx, `SELECT event_type || ': ' || reason FROM eventline.held_events WHERE kind = 'dead_letter'`)
	require.NoError(t, err)
	for rows.Next() {
		var r string
		require.NoError(t, rows.Scan(&r))
		reasons = append(reasons, r)
	}
	require.NoError(t, rows.Err())
	require.Empty(t, reasons, "the README's Router handler dead-lettered an event of another type")
	require.Equal(t, 1, pgtest.Count(t, pool, `SELECT count(*) FROM invoices WHERE order_id = 'o-1' AND amount_cents = 1250`))
	require.Equal(t, 2, pgtest.Count(t, pool, `SELECT count(*) FROM eventline.processed_events WHERE consumer_group = 'billing'`))
}

// ownDatabase creates a database of the test's own on the test server,
// for code that uses the default schema, and drops it when the test ends.
func ownDatabase(t *testing.T) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin := pgtest.Pool(t, 1)
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := "t_readme_router_" + hex.EncodeToString(b[:])
	_, err := admin.Exec(ctx, `CREATE DATABASE `+name)
	require.NoError(t, err)
	u, err := url.Parse(pgtest.URL())
	require.NoError(t, err)
	u.Path = "/" + name
	pool, err := pgxpool.New(ctx, u.String())
	require.NoError(t, err)
	t.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`); err != nil {
			t.Logf("drop database %s: %v", name, err)
		}
	})
	return pool
}
