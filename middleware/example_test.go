package middleware_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
)

// The composed middleware on your own Watermill Router, consuming Kafka
// with your own watermill-kafka subscriber: AddHandler wraps the handler in
// dead letters ▸ retries ▸ eventline, the only safe order. A redelivered
// event is applied once.
func Example_router() {
	ctx := context.Background()
	pool, schema, dropSchema := exampleDatabase()
	defer dropSchema()
	brokers, stopKafka := exampleKafka("orders")
	defer stopKafka()
	invoices := sqlident.Qualify(schema, "invoices")
	if _, err := pool.Exec(ctx, `CREATE TABLE `+invoices+` (order_id text, version bigint, total int)`); err != nil {
		panic(err)
	}

	// What the relay publishes: eventline.Encode'd messages keyed by
	// aggregate id. The second order.paid is a redelivery.
	logger := watermill.NopLogger{}
	byAggregate := kafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
		return m.Metadata.Get(eventline.MetaAggregateID), nil
	})
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: byAggregate, OverwriteSaramaConfig: kafkaconf.Producer("example")}, logger)
	if err != nil {
		panic(err)
	}
	defer pub.Close()
	created, _ := eventline.NewJSONEvent("order.created", "order", "o-1", map[string]int{"total": 30})
	created.ID, created.AggregateVersion = eventline.NewEventID(), 1
	paid, _ := eventline.NewJSONEvent("order.paid", "order", "o-1", map[string]int{"total": 30})
	paid.ID, paid.AggregateVersion = eventline.NewEventID(), 2
	for _, e := range []eventline.Event{created, paid, paid} {
		msg, err := eventline.Encode(e)
		if err != nil {
			panic(err)
		}
		if err := pub.Publish("orders", msg); err != nil {
			panic(err)
		}
	}

	// Your router, your subscriber (a new group starts at the oldest offset).
	saramaConfig := kafka.DefaultSaramaSubscriberConfig()
	saramaConfig.Consumer.Offsets.Initial = sarama.OffsetOldest
	kafkaSubscriber, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers: brokers, Unmarshaler: kafka.DefaultMarshaler{}, ConsumerGroup: "billing", OverwriteSaramaConfig: saramaConfig,
	}, logger)
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	el, err := middleware.New(pool, middleware.Config{Schema: schema, Group: "billing", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		panic(err)
	}
	var finished atomic.Int32 // deliveries handled to the end, duplicates included
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			defer finished.Add(1)
			return h(msg)
		}
	})
	_, err = el.AddHandler(router, "billing", "orders", kafkaSubscriber, func(msg *message.Message) error {
		tx, _ := middleware.TxFromContext(msg.Context())
		e, _ := middleware.EventFromContext(msg.Context())
		p, err := eventline.DecodePayload[struct{ Total int }](e)
		if err != nil {
			return middleware.Permanent(err) // dead-lettered at once
		}
		_, err = tx.Exec(msg.Context(), `INSERT INTO `+invoices+` VALUES ($1, $2, $3)`, e.AggregateID, e.AggregateVersion, p.Total)
		return err
	})
	if err != nil {
		panic(err)
	}
	go func() { _ = router.Run(ctx) }()
	<-router.Running()

	// Wait until all three deliveries, the duplicate included, are handled.
	for deadline := time.Now().Add(30 * time.Second); finished.Load() < 3 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond) // polling interval
	}
	if err := router.Close(); err != nil {
		panic(err)
	}

	rows, _ := pool.Query(ctx, `SELECT order_id, version, total FROM `+invoices+` ORDER BY version`)
	for rows.Next() {
		var id string
		var v, total int
		_ = rows.Scan(&id, &v, &total)
		fmt.Printf("%s v%d total=%d\n", id, v, total)
	}
	// Output:
	// o-1 v1 total=30
	// o-1 v2 total=30
}

// The middleware alone around a handler (MiddlewareFor), called directly
// with messages (as a Router would): a duplicate is skipped, a version that arrives early
// is parked and applied as soon as the missing one arrives, and a stale
// version is discarded.
func ExampleNew() {
	ctx := context.Background()
	pool, schema, dropSchema := exampleDatabase()
	defer dropSchema()

	el, err := middleware.New(pool, middleware.Config{Schema: schema, Group: "shipping", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		panic(err)
	}
	handle := el.MiddlewareFor("shipping")(func(msg *message.Message) ([]*message.Message, error) {
		e, _ := middleware.EventFromContext(msg.Context())
		fmt.Printf("applied %s v%d\n", e.Type, e.AggregateVersion)
		return nil, nil // write through middleware.TxFromContext(msg.Context())
	})
	event := func(typ string, version int64) *message.Message {
		msg, err := eventline.Encode(eventline.Event{ID: fmt.Sprintf("evt-%d", version), Type: typ, AggregateType: "order",
			AggregateID: "o-7", AggregateVersion: version, Payload: []byte(`{}`)})
		if err != nil {
			panic(err)
		}
		return msg
	}
	for _, msg := range []*message.Message{
		event("order.created", 1),
		event("order.created", 1), // redelivered: duplicate
		event("order.shipped", 3), // early: parked
		event("order.packed", 2),  // the missing one: applied, then 3
	} {
		if _, err := handle(msg); err != nil {
			panic(err)
		}
	}
	stale := event("order.created", 1)
	stale.UUID, stale.Metadata[eventline.MetaEventID] = "evt-other", "evt-other"
	if _, err := handle(stale); err != nil { // an older version under a new id: stale
		panic(err)
	}
	var v int64
	_ = pool.QueryRow(ctx, `SELECT version FROM `+sqlident.Qualify(schema, "aggregate_versions")+
		` WHERE consumer_group = 'shipping' AND aggregate_type = 'order' AND aggregate_id = 'o-7'`).Scan(&v)
	fmt.Println("version", v)
	// Output:
	// applied order.created v1
	// applied order.packed v2
	// applied order.shipped v3
	// version 3
}
