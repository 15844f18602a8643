package consumer_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
)

type order struct {
	Total int `json:"total"`
}

// A consumer with a typed JSON handler. The events arrive duplicated and
// out of order; each is applied once, in version order.
func Example() {
	ctx := context.Background()
	pool, schema, cleanup := exampleEnv(ctx)
	defer cleanup()
	brokers, stopKafka := exampleKafka("orders")
	defer stopKafka()
	ledger := sqlident.Qualify(schema, "ledger")
	if _, err := pool.Exec(ctx, `CREATE TABLE `+ledger+` (seq serial, line text)`); err != nil {
		panic(err)
	}

	c, err := consumer.New(pool, consumer.Config{
		Config: middleware.Config{
			Group:  "billing",
			Schema: schema,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		},
		Brokers: brokers,
		Topics:  []string{"orders"},
	})
	if err != nil {
		panic(err)
	}
	for _, typ := range []string{"order.created", "order.paid"} {
		err := consumer.HandleJSON(c, typ, func(ctx context.Context, tx pgx.Tx, e eventline.Event, o order) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+ledger+` (line) VALUES ($1)`, fmt.Sprintf("%s v%d %s total=%d", e.AggregateID, e.AggregateVersion, e.Type, o.Total))
			return err
		})
		if err != nil {
			panic(err)
		}
	}

	created, _ := eventline.NewJSONEvent("order.created", "order", "o-1", order{Total: 30})
	created.ID, created.AggregateVersion = eventline.NewEventID(), 1
	paid, _ := eventline.NewJSONEvent("order.paid", "order", "o-1", order{Total: 30})
	paid.ID, paid.AggregateVersion = eventline.NewEventID(), 2
	publishEvents(brokers, "orders", paid, created, paid) // reordered and duplicated

	ctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+ledger).Scan(&n)
		if n == 2 {
			break
		}
	}
	stop()
	if err := <-done; err != nil {
		panic(err)
	}
	rows, _ := pool.Query(context.Background(), `SELECT line FROM `+ledger+` ORDER BY seq`)
	lines, _ := pgx.CollectRows(rows, pgx.RowTo[string])
	for _, l := range lines {
		fmt.Println(l)
	}
	// Output:
	// o-1 v1 order.created total=30
	// o-1 v2 order.paid total=30
}

func exampleEnv(ctx context.Context) (*pgxpool.Pool, string, func()) {
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		panic(err)
	}
	schema := fmt.Sprintf("example_consumer_%d", time.Now().UnixNano())
	if err := migrations.Up(ctx, pool, migrations.Config{Schema: schema, Shards: 1}); err != nil {
		panic(err)
	}
	return pool, schema, func() {
		_, _ = pool.Exec(context.Background(), `DROP SCHEMA `+sqlident.Quote(schema)+` CASCADE`)
		pool.Close()
	}
}

// exampleKafka starts an in-process Kafka (kfake, reached over TCP) with
// the given topics (1 partition each). In-process even in real-broker
// mode: the examples' topic names are fixed, as in a user's code.
func exampleKafka(topics ...string) ([]string, func()) {
	c, err := kafkatest.New(context.Background(), kafkatest.Config{InProcess: true, Partitions: 1, Topics: topics})
	if err != nil {
		panic(err)
	}
	return c.Brokers, c.Close
}

func publishEvents(brokers []string, topic string, events ...eventline.Event) {
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
			return m.Metadata.Get(eventline.MetaAggregateID), nil
		}),
		OverwriteSaramaConfig: kafkaconf.Producer("example"),
	}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	defer pub.Close()
	for _, e := range events {
		msg, err := eventline.Encode(e)
		if err != nil {
			panic(err)
		}
		if err := pub.Publish(topic, msg); err != nil {
			panic(err)
		}
	}
}

// Lanes and batches: a lane's waiting events (here up to 16, waiting up
// to 200ms for the batch to fill) are applied in one PostgreSQL
// transaction, in offset order, each once.
func Example_batches() {
	ctx := context.Background()
	pool, schema, cleanup := exampleEnv(ctx)
	defer cleanup()
	brokers, stopKafka := exampleKafka("payments")
	defer stopKafka()
	ledger := sqlident.Qualify(schema, "ledger")
	if _, err := pool.Exec(ctx, `CREATE TABLE `+ledger+` (seq serial, line text, tx xid8 DEFAULT pg_current_xact_id())`); err != nil {
		panic(err)
	}

	c, err := consumer.New(pool, consumer.Config{
		Config:      middleware.Config{Group: "ledger", Schema: schema, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		Brokers:     brokers,
		Topics:      []string{"payments"},
		Lanes:       4,
		BatchSize:   16,
		BatchLinger: 200 * time.Millisecond, // here: wait for the batch to fill
	})
	if err != nil {
		panic(err)
	}
	err = c.Handle("payment.received", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+ledger+` (line) VALUES ($1)`, fmt.Sprintf("%s v%d", e.AggregateID, e.AggregateVersion))
		return err
	})
	if err != nil {
		panic(err)
	}

	var events []eventline.Event
	for v := int64(1); v <= 3; v++ {
		e, _ := eventline.NewJSONEvent("payment.received", "account", "acct-1", order{Total: int(v)})
		e.ID, e.AggregateVersion = eventline.NewEventID(), v
		events = append(events, e)
	}
	publishEvents(brokers, "payments", events...)

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+ledger).Scan(&n)
		if n == 3 {
			break
		}
	}
	stop()
	if err := <-done; err != nil {
		panic(err)
	}
	var lines []string
	var txs int
	_ = pool.QueryRow(ctx, `SELECT array_agg(line ORDER BY seq), count(DISTINCT tx) FROM `+ledger).Scan(&lines, &txs)
	fmt.Println(lines, "in", txs, "transaction")
	// Output:
	// [acct-1 v1 acct-1 v2 acct-1 v3] in 1 transaction
}
