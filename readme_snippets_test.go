package eventline_test

// The README's Go snippets, each inside a function that gives it the
// variables it uses, so `go test` and `go vet` compile every one of them.
// TestEveryReadmeGoSnippetIsCompiled checks that the README still shows
// exactly these lines.

import (
	"context"
	"errors"
	"log/slog"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
)

// OrderCreated is the README's example payload.
type OrderCreated struct {
	ID          string `json:"id"`
	AmountCents int64  `json:"amount_cents"`
}

func readmeMigrate(ctx context.Context, pool *pgxpool.Pool) error {
	err := migrations.Up(ctx, pool, migrations.Config{Schema: "eventline", Shards: 8})
	return err
}

func readmePublish(ctx context.Context, pool *pgxpool.Pool, id string, amount int64) error {
	prod, err := producer.New(ctx, pool, producer.Config{DefaultTopic: "orders"})
	if err != nil {
		return err
	}

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, amount_cents) VALUES ($1, $2)`, id, amount); err != nil {
			return err
		}
		e, err := eventline.NewJSONEvent("order.created", "order", id, OrderCreated{ID: id, AmountCents: amount})
		if err != nil {
			return err
		}
		return prod.PublishTx(ctx, tx, e) // aggregate version 1, 2, 3… assigned in tx
	})
	return err
}

func readmePublishAndCommit(ctx context.Context, pool *pgxpool.Pool, prod *producer.Producer, id string, amount int64) error {
	_, err := prod.PublishAndCommit(ctx, pool, func(tx pgx.Tx) ([]eventline.Event, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, amount_cents) VALUES ($1, $2)`, id, amount); err != nil {
			return nil, err // rolled back
		}
		e, err := eventline.NewJSONEvent("order.created", "order", id, OrderCreated{ID: id, AmountCents: amount})
		return []eventline.Event{e}, err // written, then committed with the order
	})
	return err
}

func readmeProducerPool(ctx context.Context, databaseURL string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 32
	cfg.MinConns = 32 // opened at start and kept: a new connection is a handshake and statements prepared and planned anew
	return pgxpool.NewWithConfig(ctx, cfg)
}

func readmePublishReturning(ctx context.Context, tx pgx.Tx, prod *producer.Producer, created, paid eventline.Event) error {
	written, err := prod.PublishTxReturning(ctx, tx, created, paid)
	if err != nil {
		return err
	}
	for _, e := range written { // in the order given
		slog.InfoContext(ctx, "queued", "event_id", e.ID, "aggregate", e.AggregateID, "version", e.AggregateVersion, "topic", e.Topic)
	}
	return nil
}

func readmeRelayPool(ctx context.Context, pool *pgxpool.Pool, databaseURL string) (*pgxpool.Pool, error) {
	shards, err := admin.ReadShardCount(ctx, pool, "eventline") // the schema's shard count; pool: any pool or connection to the database
	if err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = producer.PoolSizeFor(shards) // one per shard plus three; NewRelay refuses fewer (ErrPoolTooSmall)
	return pgxpool.NewWithConfig(ctx, cfg)
}

func readmeRelay(ctx context.Context, pool *pgxpool.Pool) error {
	relay, err := producer.NewRelay(ctx, pool, producer.RelayConfig{Brokers: []string{"kafka:9092"}})
	if err != nil {
		return err
	}
	go relay.Run(ctx) // returns after ctx ends and in-flight batches settle: wait for it before exiting (see "Stopping")
	return nil
}

func readmeRelayRestart(ctx context.Context, pool *pgxpool.Pool, cfg producer.RelayConfig) error {
	relay, err := producer.NewRelay(ctx, pool, cfg)
	if err != nil {
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(runCtx) }()

	// Later, to restart it (say, with a new configuration):
	stop()
	if err := <-done; err != nil { // nil after a clean stop: batches settled, shards handed over
		return err
	}
	relay, err = producer.NewRelay(ctx, pool, cfg) // a Relay runs once: a second Run returns ErrRelayRunning
	if err != nil {
		return err
	}
	return relay.Run(ctx)
}

func readmeConsume(ctx context.Context, pool *pgxpool.Pool) error {
	c, err := consumer.New(pool, consumer.Config{
		Config:  middleware.Config{Group: "billing"}, // eventline's settings, shared with the middleware: group, retries, policies…
		Brokers: []string{"kafka:9092"},
		Topics:  []string{"orders"},
	})
	if err != nil {
		return err
	}
	err = consumer.HandleJSON(c, "order.created", func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderCreated) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id, amount_cents) VALUES ($1, $2)`, o.ID, o.AmountCents)
		return err
	})
	if err != nil {
		return err
	}
	err = c.Run(ctx)
	return err
}

func readmeConsumerPool(ctx context.Context, databaseURL string, partitions int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = partitions*consumer.DefaultLanes + 2 // a transaction per lane, plus the sweeper and dead-letter replays
	return pgxpool.NewWithConfig(ctx, cfg)
}

func readmeOwnRouter(ctx context.Context, pool *pgxpool.Pool, brokers []string) error {
	logger := watermill.NewSlogLogger(slog.Default())
	saramaConfig := kafka.DefaultSaramaSubscriberConfig()
	saramaConfig.Consumer.Offsets.Initial = sarama.OffsetOldest // a new group starts at the oldest record, not the newest
	kafkaSubscriber, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               brokers,
		Unmarshaler:           kafka.DefaultMarshaler{}, // what the relay writes: eventline.Encode'd messages, metadata as headers
		ConsumerGroup:         "billing",                // Kafka's group: partitions and committed offsets
		OverwriteSaramaConfig: saramaConfig,
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}

	el, err := middleware.New(pool, middleware.Config{Group: "billing"}) // eventline's group: dedup records, versions, parked events
	if err != nil {
		return err
	}
	_, err = el.AddHandler(router, "billing", "orders", kafkaSubscriber, func(msg *message.Message) error {
		ctx := msg.Context()
		tx, ok := middleware.TxFromContext(ctx)
		if !ok {
			return middleware.ErrNoTx // not behind the eventline middleware: AddHandler always puts it there
		}
		e, ok := middleware.EventFromContext(ctx)
		if !ok {
			return middleware.Permanent(errors.New("no eventline event in the message context"))
		}
		if e.Type != "order.created" {
			return nil // every event type of the topic comes here: let the others pass (applied as no-ops)
		}
		o, err := eventline.DecodePayload[OrderCreated](e) // an error here is permanent: dead-lettered at once
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `INSERT INTO invoices (order_id, amount_cents, late) VALUES ($1, $2, $3)`,
			o.ID, o.AmountCents, middleware.IsLate(ctx))
		return err
	})
	if err != nil {
		return err
	}
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return el.Run(ctx) }) // checks the schema (middleware.ErrNotMigrated), then applies parked events and replays dead letters on request
	g.Go(func() error { return router.Run(ctx) })
	return g.Wait()
}

func readmeSeveralHandlers(router *message.Router, el *middleware.Eventline, ordersSub, refundsSub message.Subscriber,
	onOrder, onRefund message.NoPublishHandlerFunc,
) error {
	// The safe chain, one call per handler; each is registered under its name.
	if _, err := el.AddHandler(router, "billing.orders", "orders", ordersSub, onOrder); err != nil {
		return err
	}
	if _, err := el.AddHandler(router, "billing.refunds", "refunds", refundsSub, onRefund); err != nil {
		return err
	}
	return nil
}

func readmeUpcasters(pool *pgxpool.Pool, router *message.Router, sub message.Subscriber, onOrder message.NoPublishHandlerFunc) error {
	up, err := eventline.NewUpcasters(map[string]int{"order.created": 3},
		eventline.Upcaster{Type: "order.created", From: 1, Func: renameAmount}, // v1 {"amount"} → v2 {"amount_cents"}
		eventline.Upcaster{Type: "order.created", From: 2, Func: addCurrency},  // v2 → v3, adds "currency"
	)
	if err != nil {
		return err
	}

	// The ready runner: every handler gets version 3.
	c, err := consumer.New(pool, consumer.Config{Config: middleware.Config{Group: "billing", Upcasters: up}, Topics: []string{"orders"}})

	// Your own Router: the middleware upcasts inside the safe chain, so
	// parked events and replayed dead letters are upcast too.
	el, err := middleware.New(pool, middleware.Config{Group: "billing", Upcasters: up})
	if err != nil {
		return err
	}
	_, err = el.AddHandler(router, "billing", "orders", sub, onOrder)

	_ = c
	return err
}

var (
	_ = readmeMigrate
	_ = readmePublish
	_ = readmePublishReturning
	_ = readmeRelayPool
	_ = readmeRelay
	_ = readmeRelayRestart
	_ = readmeConsume
	_ = readmeConsumerPool
	_ = readmeOwnRouter
	_ = readmeSeveralHandlers
	_ = readmeUpcasters
)
