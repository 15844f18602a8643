// Command crash-window reproduces the outbox's crash window: the relay
// publishes an event to Kafka and dies before the outbox records that it did.
//
// Nothing is lost: the event is still pending in the outbox, so the next relay
// publishes it again, and Kafka ends up holding it twice. That is
// at-least-once delivery, and it is why the consumer side needs
// idempotency: eventline's middleware records the event id in the same
// transaction as the handler's effect, so the second copy changes nothing.
//
//	go run ./examples/crash-window
//
// Output, one key=value line per step:
//
//	order_id=1 message_id=0193… aggregate_version=1
//	first_relay published=1 outbox_acked=0 simulated_crash=true
//	published_after_crash=1 outbox_pending=1
//	second_relay published=1 outbox_acked=1
//	published_after_retry=2 outbox_pending=0
//	consumer delivered=2 applied=1 duplicates_skipped=1
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/examples/internal/setup"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
)

func main() {
	var cfg setup.Common
	setup.Main("crash-window", "example_crash_window", &cfg, func(ctx context.Context) error { return run(ctx, cfg, os.Stdout) })
}

// The business tables: orders on the producer side, shipments written by
// the consumer. shipments has no unique constraint on purpose: if an event
// were applied twice, it would show as two rows.
var ddl = []string{
	`CREATE TABLE orders (
		id           bigserial   PRIMARY KEY,
		order_no     text        NOT NULL UNIQUE,
		amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
		created_at   timestamptz NOT NULL DEFAULT now())`,
	`CREATE TABLE shipments (
		id         bigserial   PRIMARY KEY,
		order_id   bigint      NOT NULL,
		event_id   text        NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`,
}

// OrderCreated is the payload of order.created events.
type OrderCreated struct {
	OrderID     int64  `json:"order_id"`
	OrderNo     string `json:"order_no"`
	AmountCents int64  `json:"amount_cents"`
}

func run(ctx context.Context, cfg setup.Common, stdout io.Writer) (err error) {
	// One outbox shard keeps the story simple; any number works the same.
	env, err := setup.Start(ctx, cfg, 4, 1, ddl...)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, env.Close(ctx)) }()
	k, db, log := env.Kafka, env.DB, env.Log
	topic := k.Topic("orders")
	if err := k.CreateTopics(ctx, 1, topic); err != nil {
		return err
	}

	// 1. The business transaction: the order row and its event commit
	// together, or not at all. Nothing is sent to Kafka here.
	p, err := producer.New(ctx, db, producer.Config{Schema: cfg.Schema, DefaultTopic: topic})
	if err != nil {
		return err
	}
	order, event, err := createOrder(ctx, db, p, cfg.Schema, "A-1001", 4200)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "order_id=%d message_id=%s aggregate_version=%d\n", order, event.ID, event.AggregateVersion)

	// 2. A relay that dies in the window: Kafka has acknowledged the
	// event, the outbox has not recorded it.
	published, err := relayThenCrash(ctx, cfg, log, k.Brokers)
	if err != nil {
		return err
	}
	copies, err := copiesInKafka(ctx, k, topic, event.ID)
	if err != nil {
		return err
	}
	pending, err := outboxPending(ctx, db, cfg.Schema)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "first_relay published=%d outbox_acked=%d simulated_crash=true\n", published, 1-pending)
	fmt.Fprintf(stdout, "published_after_crash=%d outbox_pending=%d\n", copies, pending)
	if copies != 1 || pending != 1 {
		return fmt.Errorf("after the crash Kafka should hold the event once (got %d) and the outbox should still have it pending (got %d)", copies, pending)
	}

	// 3. The relay is restarted. It starts from the outbox's last recorded
	// position, so it publishes the event again.
	published, err = relayUntilDrained(ctx, cfg, log, k.Brokers)
	if err != nil {
		return err
	}
	copies, err = copiesInKafka(ctx, k, topic, event.ID)
	if err != nil {
		return err
	}
	before := pending
	pending, err = outboxPending(ctx, db, cfg.Schema)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "second_relay published=%d outbox_acked=%d\n", published, before-pending)
	fmt.Fprintf(stdout, "published_after_retry=%d outbox_pending=%d\n", copies, pending)
	if copies != 2 || pending != 0 {
		return fmt.Errorf("after the retry Kafka should hold the event twice (got %d) and the outbox nothing pending (got %d)", copies, pending)
	}

	// 4. A consumer reads both copies; the middleware applies the effect once.
	delivered, duplicates, err := consume(ctx, cfg, log, k.Brokers, topic, k.Group("shipping"))
	if err != nil {
		return err
	}
	var applied int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{cfg.Schema, "shipments"}.Sanitize()+` WHERE order_id = $1`, order).Scan(&applied); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "consumer delivered=%d applied=%d duplicates_skipped=%d\n", delivered, applied, duplicates)
	if applied != 1 || duplicates != 1 {
		return fmt.Errorf("the order's shipment should be created once (got %d rows) and the second copy skipped as a duplicate (got %d)", applied, duplicates)
	}
	return nil
}

// createOrder inserts an order and writes its order.created event into the
// outbox in the same transaction, like the seed's CreateOrder.
func createOrder(ctx context.Context, db *pgxpool.Pool, p *producer.Producer, schema, orderNo string, amount int64) (int64, eventline.Event, error) {
	var e eventline.Event
	var orderID int64
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, `INSERT INTO `+pgx.Identifier{schema, "orders"}.Sanitize()+` (order_no, amount_cents) VALUES ($1, $2) RETURNING id`,
			orderNo, amount).Scan(&orderID)
		if err != nil {
			return fmt.Errorf("insert order: %w", err)
		}
		e, err = eventline.NewJSONEvent("order.created", "order", fmt.Sprint(orderID), OrderCreated{OrderID: orderID, OrderNo: orderNo, AmountCents: amount})
		if err != nil {
			return err
		}
		// Chosen here rather than by the producer, so we can print them.
		e.ID, e.AggregateVersion = eventline.NewEventID(), 1
		return p.PublishTx(ctx, tx, e)
	})
	return orderID, e, err
}

// errCrashed is what the crashing relay's AfterPublish hook returns.
var errCrashed = errors.New("simulated crash: the relay process died after Kafka acknowledged, before the outbox ack")

// relayThenCrash runs a relay until Kafka has acknowledged its first batch,
// then kills it before it records that batch in the outbox. It returns how
// many events that batch held.
func relayThenCrash(ctx context.Context, cfg setup.Common, log *slog.Logger, brokers []string) (int, error) {
	// A dead process cannot reach the database either. The relay's pool
	// refuses every new connection from the crash on, so the dying relay
	// cannot read the outbox again (and re-publish) while it shuts down.
	var dead atomic.Bool
	pool, err := relayPool(ctx, cfg, func(context.Context, *pgx.Conn) (bool, error) {
		if dead.Load() {
			return false, errCrashed
		}
		return true, nil
	})
	if err != nil {
		return 0, err
	}
	defer pool.Close()

	relayCtx, kill := context.WithTimeout(ctx, time.Minute)
	defer kill()
	var published atomic.Int64
	// The relay's AfterPublish hook: Kafka has the batch, the outbox does
	// not know yet. The process dies here.
	relay, err := newRelay(ctx, pool, cfg, log, brokers, "relay-1", func(_ int, eventIDs []string) error {
		if dead.CompareAndSwap(false, true) {
			published.Store(int64(len(eventIDs)))
			kill()
		}
		return errCrashed
	})
	if err != nil {
		return 0, err
	}
	if err := relay.Run(relayCtx); err != nil {
		return 0, err
	}
	if !dead.Load() {
		return 0, fmt.Errorf("the first relay published nothing: %w", context.Cause(relayCtx))
	}
	return int(published.Load()), nil
}

// relayUntilDrained runs a healthy relay until the outbox has nothing left
// to forward, and returns how many events it published.
func relayUntilDrained(ctx context.Context, cfg setup.Common, log *slog.Logger, brokers []string) (int, error) {
	pool, err := relayPool(ctx, cfg, nil)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	var published atomic.Int64
	relay, err := newRelay(ctx, pool, cfg, log, brokers, "relay-2", func(_ int, eventIDs []string) error {
		published.Add(int64(len(eventIDs))) // here the hook only counts
		return nil
	})
	if err != nil {
		return 0, err
	}
	relayCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(relayCtx) }()
	waitErr := setup.WaitFor(ctx, 30*time.Second, "the second relay to drain the outbox", func() (bool, error) {
		n, err := outboxPending(ctx, pool, cfg.Schema)
		return n == 0, err
	})
	stop()
	return int(published.Load()), errors.Join(waitErr, <-done)
}

// consume runs a Watermill router with eventline's middleware until both
// copies of the event went through it. It returns how many messages the
// handler chain received and how many the middleware skipped as duplicates.
func consume(ctx context.Context, cfg setup.Common, log *slog.Logger, brokers []string, topic, group string) (delivered, duplicates int, err error) {
	db, err := setup.Pool(ctx, cfg.DatabaseURL, setup.AppName(cfg.Schema), 3)
	if err != nil {
		return 0, 0, err
	}
	defer db.Close()

	reg := prometheus.NewRegistry()
	metrics, err := middleware.NewMetrics(reg)
	if err != nil {
		return 0, 0, err
	}
	el, err := middleware.New(db, middleware.Config{Group: group, Schema: cfg.Schema, Logger: log, Metrics: metrics})
	if err != nil {
		return 0, 0, err
	}

	// A plain watermill-kafka subscriber. A new consumer group must start at
	// the oldest offset, or it misses what was published before it joined.
	saramaCfg := kafka.DefaultSaramaSubscriberConfig()
	saramaCfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	wlog := watermill.NewSlogLogger(log)
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: saramaCfg,
		ConsumerGroup:         group,
	}, wlog)
	if err != nil {
		return 0, 0, err
	}
	defer sub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, wlog)
	if err != nil {
		return 0, 0, err
	}

	var seen atomic.Int64
	countDeliveries := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				seen.Add(1)
			}
			return out, err
		}
	}
	const handler = "ship-orders"
	router.AddConsumerHandler(handler, topic, sub, ship(pgx.Identifier{cfg.Schema, "shipments"}.Sanitize())).
		AddMiddleware(countDeliveries, el.MiddlewareFor(handler))

	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(context.WithoutCancel(ctx)) }()
	waitErr := setup.WaitFor(ctx, time.Minute, "the consumer to receive both copies", func() (bool, error) {
		return seen.Load() >= 2, nil
	})
	closeErr := router.Close()
	err = errors.Join(waitErr, closeErr, <-runErr)
	return int(seen.Load()), int(setup.Counter(reg, "eventline_consumer_events_duplicate_total", nil)), err
}

// ship is the consumer's Watermill handler: it writes the shipment into
// the table shipments (its SQL name) through the consumer transaction the
// middleware opened, so it commits with the dedup record.
func ship(shipments string) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		tx, ok := middleware.TxFromContext(msg.Context())
		if !ok {
			return middleware.ErrNoTx
		}
		e, ok := middleware.EventFromContext(msg.Context())
		if !ok {
			return middleware.Permanent(errors.New("no decoded event in the message context: run the handler behind eventline's middleware"))
		}
		order, err := eventline.DecodePayload[OrderCreated](e)
		if err != nil {
			return middleware.Permanent(err)
		}
		_, err = tx.Exec(msg.Context(), `INSERT INTO `+shipments+` (order_id, event_id) VALUES ($1, $2)`, order.OrderID, e.ID)
		return err
	}
}

// newRelay returns a relay whose afterPublish hook runs after Kafka
// acknowledged a batch and before the outbox records it: the crash window.
func newRelay(ctx context.Context, pool *pgxpool.Pool, cfg setup.Common, log *slog.Logger, brokers []string, id string,
	afterPublish func(shard int, eventIDs []string) error) (*producer.Relay, error) {
	return producer.NewRelay(ctx, pool, producer.RelayConfig{
		Schema:          cfg.Schema,
		ID:              id,
		Brokers:         brokers,
		AfterPublish:    afterPublish,
		CleanupInterval: -1,
		Logger:          log,
	})
}

// relayPool opens the pool a relay needs: one connection per shard plus
// three.
func relayPool(ctx context.Context, cfg setup.Common, prepare func(context.Context, *pgx.Conn) (bool, error)) (*pgxpool.Pool, error) {
	return setup.Pool(ctx, cfg.DatabaseURL, setup.AppName(cfg.Schema), 4, func(c *pgxpool.Config) { c.PrepareConn = prepare })
}

func outboxPending(ctx context.Context, db admin.DBTX, schema string) (int64, error) {
	st, err := admin.ReadOutboxStatus(ctx, db, schema)
	if err != nil {
		return 0, err
	}
	return st.Backlog(), nil
}

func copiesInKafka(ctx context.Context, k *setup.Kafka, topic, eventID string) (int, error) {
	records, err := k.ReadTopic(ctx, topic)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, r := range records {
		if r.EventID == eventID {
			n++
		}
	}
	return n, nil
}
