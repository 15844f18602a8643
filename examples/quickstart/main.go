// Command quickstart is a whole first eventline program in one file, written
// with the public API only, so it can be copied into a module of your own: it
// applies the schema, publishes events in business transactions, runs a relay
// and a consumer, waits until every event is applied, checks that each was
// applied once and in order, and shuts everything down.
//
// It needs PostgreSQL (DATABASE_URL, default
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable) and Kafka with
// the topic created. For development, eventline's CLI runs an in-process
// one:
//
//	go run -C cmd/eventline . kafka-dev -topics orders  # prints KAFKA_BROKERS=127.0.0.1:9092; leave it running
//	KAFKA_BROKERS=127.0.0.1:9092 go run ./examples/quickstart
//
// It (re)creates its own schema (-schema, default "quickstart") holding both
// eventline's tables and its business tables, but not the topic: run it
// again on the same topic only after a run that finished (group billing has
// then consumed the earlier events), or give it a new one (-topic). It
// prints one line:
//
//	orders=20 published=200 applied=200 in_order=true elapsed=1.2s
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
)

type config struct {
	DatabaseURL string
	Brokers     []string
	Schema      string // eventline's tables and, in this one-file program, the business tables
	Topic       string // must exist on Kafka: eventline creates no topics
	Orders      int    // aggregates
	Items       int    // order.item_added events per order, after its order.created
	Logger      *slog.Logger
}

// OrderCreated and ItemAdded are the event payloads, encoded as JSON.
type OrderCreated struct {
	ID          string `json:"id"`
	AmountCents int64  `json:"amount_cents"`
}

type ItemAdded struct {
	ID          string `json:"id"`
	Item        int    `json:"item"`
	AmountCents int64  `json:"amount_cents"`
}

func main() {
	cfg := config{DatabaseURL: os.Getenv("DATABASE_URL"), Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if cfg.DatabaseURL == "" {
		cfg.DatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	flag.StringVar(&cfg.Schema, "schema", "quickstart", "PostgreSQL schema to (re)create for eventline's and the business tables")
	flag.StringVar(&cfg.Topic, "topic", "orders", "Kafka topic of the order events (create it first)")
	flag.IntVar(&cfg.Orders, "orders", 20, "number of orders")
	flag.IntVar(&cfg.Items, "items", 9, "order.item_added events per order")
	flag.Parse()
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		cfg.Brokers = strings.Split(env, ",")
	} else {
		fmt.Fprintln(os.Stderr, "quickstart: set KAFKA_BROKERS (for development: go run -C cmd/eventline . kafka-dev -topics orders)")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		stop()
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config, stdout io.Writer) error {
	start := time.Now()
	pool, err := pgxpool.New(ctx, cfg.DatabaseURL) // the producer's and the consumer's pool
	if err != nil {
		return err
	}
	defer pool.Close()

	// The schema: eventline's tables (migrations.Up is idempotent and safe to
	// run from several processes), then the business tables.
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{cfg.Schema}.Sanitize()+` CASCADE`); err != nil {
		return err
	}
	if err := migrations.Up(ctx, pool, migrations.Config{Schema: cfg.Schema, Shards: 4}); err != nil {
		return err
	}
	orders := pgx.Identifier{cfg.Schema, "orders"}.Sanitize()
	orderLines := pgx.Identifier{cfg.Schema, "order_lines"}.Sanitize()   // the consumer's effect: one row per applied event
	orderTotals := pgx.Identifier{cfg.Schema, "order_totals"}.Sanitize() // the consumer's view: last version applied, total
	if _, err := pool.Exec(ctx, `
		CREATE TABLE `+orders+` (id text PRIMARY KEY, amount_cents bigint NOT NULL);
		CREATE TABLE `+orderLines+` (order_id text, version bigint, event_type text NOT NULL, PRIMARY KEY (order_id, version));
		CREATE TABLE `+orderTotals+` (order_id text PRIMARY KEY, version bigint NOT NULL, amount_cents bigint NOT NULL)`); err != nil {
		return err
	}

	// Publish: each event in the transaction that writes its business row.
	// eventline's tables are in cfg.Schema, not the default "eventline", so
	// every config below names it.
	prod, err := producer.New(ctx, pool, producer.Config{DefaultTopic: cfg.Topic, Schema: cfg.Schema, Logger: cfg.Logger})
	if err != nil {
		return err
	}
	for item := 0; item <= cfg.Items; item++ {
		for o := 0; o < cfg.Orders; o++ {
			id := fmt.Sprintf("o-%03d", o)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var e eventline.Event
				var err error
				if item == 0 {
					if _, err := tx.Exec(ctx, `INSERT INTO `+orders+` (id, amount_cents) VALUES ($1, 0)`, id); err != nil {
						return err
					}
					e, err = eventline.NewJSONEvent("order.created", "order", id, OrderCreated{ID: id})
				} else {
					if _, err := tx.Exec(ctx, `UPDATE `+orders+` SET amount_cents = amount_cents + 100 WHERE id = $1`, id); err != nil {
						return err
					}
					e, err = eventline.NewJSONEvent("order.item_added", "order", id, ItemAdded{ID: id, Item: item, AmountCents: 100})
				}
				if err != nil {
					return err
				}
				return prod.PublishTx(ctx, tx, e) // versions 1, 2, 3… per order, assigned in tx
			})
			if err != nil {
				return fmt.Errorf("publish: %w", err)
			}
		}
	}
	published := cfg.Orders * (cfg.Items + 1)

	// The relay, on a pool of its own, sized for the shards.
	shards, err := admin.ReadShardCount(ctx, pool, cfg.Schema)
	if err != nil {
		return err
	}
	relayPoolConfig, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return err
	}
	relayPoolConfig.MaxConns = producer.PoolSizeFor(shards) // one per shard plus three
	relayPool, err := pgxpool.NewWithConfig(ctx, relayPoolConfig)
	if err != nil {
		return err
	}
	defer relayPool.Close()
	relay, err := producer.NewRelay(ctx, relayPool, producer.RelayConfig{Brokers: cfg.Brokers, Schema: cfg.Schema, Logger: cfg.Logger})
	if err != nil {
		return err
	}

	// The consumer: a handler per event type, each writing its effects
	// through the consumer transaction tx.
	c, err := consumer.New(pool, consumer.Config{
		Config: middleware.Config{
			Group:  "billing",
			Schema: cfg.Schema,
			Logger: cfg.Logger,
		},
		Brokers: cfg.Brokers,
		Topics:  []string{cfg.Topic},
	})
	if err != nil {
		return err
	}
	apply := func(ctx context.Context, tx pgx.Tx, e eventline.Event, amount int64) error {
		// eventline hands over an order's events in version order, once each;
		// this check is here to show it, a handler does not need one.
		var last int64
		err := tx.QueryRow(ctx, `SELECT version FROM `+orderTotals+` WHERE order_id = $1`, e.AggregateID).Scan(&last)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		if e.AggregateVersion != last+1 {
			return fmt.Errorf("order %s: version %d applied after %d", e.AggregateID, e.AggregateVersion, last)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+orderTotals+` (order_id, version, amount_cents) VALUES ($1, $2, $3)
			ON CONFLICT (order_id) DO UPDATE SET version = EXCLUDED.version, amount_cents = `+orderTotals+`.amount_cents + EXCLUDED.amount_cents`,
			e.AggregateID, e.AggregateVersion, amount); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `INSERT INTO `+orderLines+` (order_id, version, event_type) VALUES ($1, $2, $3)`, e.AggregateID, e.AggregateVersion, e.Type)
		return err
	}
	if err := consumer.HandleJSON(c, "order.created", func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderCreated) error {
		return apply(ctx, tx, e, o.AmountCents)
	}); err != nil {
		return err
	}
	if err := consumer.HandleJSON(c, "order.item_added", func(ctx context.Context, tx pgx.Tx, e eventline.Event, i ItemAdded) error {
		return apply(ctx, tx, e, i.AmountCents)
	}); err != nil {
		return err
	}

	// Run both until every event is applied, then stop them: cancel their
	// context and wait for Run to return (nil after a clean stop).
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	relayDone, consumerDone := make(chan error, 1), make(chan error, 1)
	go func() { relayDone <- relay.Run(runCtx) }()
	go func() { consumerDone <- c.Run(runCtx) }()

	applied, err := waitApplied(ctx, pool, orderLines, published, relayDone, consumerDone)
	cancel()
	relayErr, consumerErr := <-relayDone, <-consumerDone
	if err := errors.Join(err, relayErr, consumerErr); err != nil {
		return err
	}

	// Each order's versions 1..n applied once, and its total is the sum of
	// its events: nothing lost, nothing applied twice.
	var wrong int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+orders+` o
		LEFT JOIN (SELECT order_id, count(*) n, max(version) v FROM `+orderLines+` GROUP BY order_id) l ON l.order_id = o.id
		LEFT JOIN `+orderTotals+` t ON t.order_id = o.id
		WHERE l.n IS DISTINCT FROM $1::bigint OR l.v IS DISTINCT FROM $1::bigint OR t.amount_cents IS DISTINCT FROM o.amount_cents`,
		cfg.Items+1).Scan(&wrong); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "orders=%d published=%d applied=%d in_order=%t elapsed=%s\n",
		cfg.Orders, published, applied, wrong == 0, time.Since(start).Round(time.Millisecond))
	if wrong != 0 {
		return fmt.Errorf("%d orders do not have each event applied once, in order", wrong)
	}
	return nil
}

// waitApplied polls the effect table until want rows are there, and returns
// early if the relay or the consumer stops (their error, sent back on its
// channel for the caller to read) or ctx ends.
func waitApplied(ctx context.Context, pool *pgxpool.Pool, table string, want int, relayDone, consumerDone chan error) (int, error) {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil {
			return n, err
		}
		if n >= want {
			return n, nil
		}
		select {
		case err := <-relayDone:
			relayDone <- err
			return n, fmt.Errorf("the relay stopped with %d of %d events applied", n, want)
		case err := <-consumerDone:
			consumerDone <- err
			return n, fmt.Errorf("the consumer stopped with %d of %d events applied", n, want)
		case <-ctx.Done():
			return n, fmt.Errorf("%d of %d events applied: %w", n, want, ctx.Err())
		case <-tick.C:
		}
	}
}
