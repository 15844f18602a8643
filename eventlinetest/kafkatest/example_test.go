package kafkatest_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/eventlinetest/kafkatest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
)

type OrderCreated struct {
	ID          string `json:"id"`
	AmountCents int64  `json:"amount_cents"`
}

func invoice(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderCreated) error {
	_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id, amount_cents) VALUES ($1, $2)`, o.ID, o.AmountCents)
	return err
}

// testDatabase stands for your own test database helper: a pool on a
// schema of its own, with eventline's migrations and the invoices table,
// and search_path set to it.
func testDatabase(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	url := os.Getenv("TEST_DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	schema := "kafkatest_example_" + hex.EncodeToString(b[:])
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		pool.Close()
	})
	require.NoError(t, migrations.Up(t.Context(), pool, migrations.Config{Schema: schema, Shards: 1}))
	_, err = pool.Exec(t.Context(), `CREATE TABLE invoices (order_id text PRIMARY KEY, amount_cents bigint NOT NULL)`)
	require.NoError(t, err)
	return pool, schema
}

// TestBillingConsumer is the README's in-process Kafka snippet: the ready
// runner against a Kafka cluster started for the test.
func TestBillingConsumer(t *testing.T) {
	ctx := t.Context()
	pool, schema := testDatabase(t)
	topic, group := kafkatest.Topic("orders"), kafkatest.Topic("billing") // unique: a real cluster may be shared
	k := kafkatest.Start(t, topic)                                        // in-process Kafka, or the cluster in $KAFKA_BROKERS

	c, err := consumer.New(pool, consumer.Config{
		Config: middleware.Config{
			Group:  group,
			Schema: schema,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		},
		Brokers: k.Brokers,
		Topics:  []string{topic},
	})
	require.NoError(t, err)
	require.NoError(t, consumer.HandleJSON(c, "order.created", invoice))
	e, err := eventline.NewJSONEvent("order.created", "order", "o-1", OrderCreated{ID: "o-1", AmountCents: 1250})
	require.NoError(t, err)
	e.AggregateVersion = 1 // the producer would assign it
	require.NoError(t, kafkatest.Publish(ctx, k.Brokers, topic, e))

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	require.Eventually(t, func() bool {
		var n int
		return pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&n) == nil && n == 1
	}, 30*time.Second, 20*time.Millisecond)
	stop()
	require.NoError(t, <-done)
}

// New starts a cluster outside a test, e.g. in TestMain, to share one
// among a package's tests.
func ExampleNew() {
	ctx := context.Background()
	k, err := kafkatest.New(ctx, kafkatest.Config{Topics: []string{"orders"}, InProcess: true})
	if err != nil {
		panic(err)
	}
	defer k.Close()
	e, err := eventline.NewJSONEvent("order.created", "order", "o-1", OrderCreated{ID: "o-1", AmountCents: 1250})
	if err != nil {
		panic(err)
	}
	fmt.Println(k.InProcess(), len(k.Brokers), kafkatest.Publish(ctx, k.Brokers, "orders", e))
	// Output: true 1 <nil>
}
