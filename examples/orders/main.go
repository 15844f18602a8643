// Command orders is eventline's end-to-end demo (`make demo`): orders are
// created together with their order.created events in one transaction, a
// relay forwards the events to Kafka, and two consumer groups, billing and
// shipping, apply every event exactly once to their own tables, although
// some events are delivered twice.
//
//	go run ./examples/orders [-orders 1000] [-redeliver-every 10] [-trace]
//
// It prints progress lines, then one summary line, and exits with status 1
// unless the database shows every order billed once and shipped once:
//
//	orders=1000 forwarded=1000 republished=100 redelivered=200 billing_applied=1000 shipping_applied=1000 duplicates_skipped=200 elapsed=…
//
// republished counts the records written to Kafka a second time. Each of
// them reaches both consumer groups, so redelivered = 2 × republished, and
// the dedup record must recognise every one of those deliveries:
// duplicates_skipped, billing's plus shipping's, equals redelivered.
//
// With -trace, the relay and the consumers trace every event with
// OpenTelemetry (kept in memory here), and the spans of one order, one
// that was delivered twice, are printed at the end as an indented tree:
// the transaction that created it, the relay's send, each group's process
// span with its outcome (applied, then duplicate) and the handler's own
// span nested inside.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/examples/internal/setup"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
)

type config struct {
	setup.Common
	// Orders is how many orders to create.
	Orders int
	// RedeliverEvery sends every n-th order's event to Kafka a second
	// time; 0 sends none twice.
	RedeliverEvery int
	// Writers is how many transactions create orders concurrently.
	Writers int
	// Progress is the interval between progress lines; 0 prints none.
	Progress time.Duration
	// Trace traces the pipeline and prints one order's trace at the end.
	Trace bool
}

func main() {
	var cfg config
	flag.IntVar(&cfg.Orders, "orders", 1000, "number of orders to create")
	flag.IntVar(&cfg.RedeliverEvery, "redeliver-every", 10, "publish every n-th order's event to Kafka a second time (0: none)")
	flag.IntVar(&cfg.Writers, "writers", 4, "concurrent order-creating transactions")
	flag.DurationVar(&cfg.Progress, "progress", time.Second, "interval between progress lines (0: none)")
	flag.BoolVar(&cfg.Trace, "trace", false, "trace every event with OpenTelemetry and print one order's spans at the end")
	setup.Main("orders", "example_orders", &cfg.Common, func(ctx context.Context) error { return run(ctx, cfg, os.Stdout) })
}

// The business tables. invoices and shipments deliberately have no unique
// constraint on order_id: an event applied twice would show as two rows.
var ddl = []string{
	`CREATE TABLE orders (
		id           bigserial   PRIMARY KEY,
		order_no     text        NOT NULL UNIQUE,
		amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
		created_at   timestamptz NOT NULL DEFAULT now())`,
	`CREATE TABLE invoices (
		id           bigserial   PRIMARY KEY,
		order_id     bigint      NOT NULL,
		amount_cents bigint      NOT NULL,
		event_id     text        NOT NULL)`,
	`CREATE TABLE shipments (
		id           bigserial   PRIMARY KEY,
		order_id     bigint      NOT NULL,
		event_id     text        NOT NULL)`,
}

// OrderCreated is the payload of order.created events.
type OrderCreated struct {
	OrderID     int64  `json:"order_id"`
	OrderNo     string `json:"order_no"`
	AmountCents int64  `json:"amount_cents"`
}

// orderHandler handles order.created in a consumer group. Its writes go
// through tx, the consumer transaction: they commit together with the
// event's dedup record, or not at all.
type orderHandler func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderCreated) error

// bill is the billing group's handler: one invoice per order, in the
// table invoices (an SQL name, e.g. "shop"."invoices").
func bill(invoices string) orderHandler {
	return func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderCreated) error {
		ctx, span := userSpan(ctx, "insert invoice")
		defer span.End()
		_, err := tx.Exec(ctx, `INSERT INTO `+invoices+` (order_id, amount_cents, event_id) VALUES ($1, $2, $3)`, o.OrderID, o.AmountCents, e.ID)
		return err
	}
}

// ship is the shipping group's handler: one shipment per order, in the
// table shipments.
func ship(shipments string) orderHandler {
	return func(ctx context.Context, tx pgx.Tx, e eventline.Event, o OrderCreated) error {
		ctx, span := userSpan(ctx, "insert shipment")
		defer span.End()
		_, err := tx.Exec(ctx, `INSERT INTO `+shipments+` (order_id, event_id) VALUES ($1, $2)`, o.OrderID, e.ID)
		return err
	}
}

// userSpan starts a span of the application's own under the span in ctx
// (the consumer's process span), with the same provider: without tracing,
// a no-op.
func userSpan(ctx context.Context, name string) (context.Context, trace.Span) {
	return trace.SpanFromContext(ctx).TracerProvider().Tracer("orders").Start(ctx, name)
}

// groups are the consumer groups, each with its handler and effects table.
var groups = []struct {
	name, table string
	handler     func(table string) orderHandler
}{
	{"billing", "invoices", bill},
	{"shipping", "shipments", ship},
}

func run(ctx context.Context, cfg config, stdout io.Writer) (err error) {
	start := time.Now()
	if cfg.Orders <= 0 || cfg.Writers <= 0 || cfg.RedeliverEvery < 0 {
		return errors.New("-orders and -writers must be positive, -redeliver-every not negative")
	}

	// Kafka, and PostgreSQL: one schema holds eventline's tables and the
	// business tables. Every component has its own small pool.
	const shards = 2
	env, err := setup.Start(ctx, cfg.Common, int32(cfg.Writers)+1, shards, ddl...)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, env.Close(ctx)) }()
	k, db, log := env.Kafka, env.DB, env.Log

	// The events topic (eventline does not create topics).
	topic := k.Topic("orders")
	if err := k.CreateTopics(ctx, 4, topic); err != nil {
		return err
	}
	// Group and topic names get a suffix unique to the run (billing-3fa2c1),
	// so runs against a shared cluster never mix.
	groupID := map[string]string{}
	for _, g := range groups {
		groupID[g.name] = k.Group(g.name)
	}
	relayDB, err := env.Pool(ctx, shards+3) // one per shard, plus three
	if err != nil {
		return err
	}
	consumerDB := map[string]*pgxpool.Pool{}
	for _, g := range groups {
		if consumerDB[g.name], err = env.Pool(ctx, 4); err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "schema=%s topic=%s shards=%d kafka=%s\n", cfg.Schema, topic, shards, kafkaName(k))

	// Prometheus collectors, read back for the progress and summary lines.
	reg := prometheus.NewRegistry()
	relayMetrics, err := producer.NewRelayMetrics(reg)
	if err != nil {
		return err
	}
	consumerMetrics, err := middleware.NewMetrics(reg)
	if err != nil {
		return err
	}
	// Tracing: an in-memory span recorder stands in for an OTLP exporter.
	// A nil TracerProvider (no -trace) turns tracing off.
	var spans *tracingtest.Recorder
	var tp trace.TracerProvider
	if cfg.Trace {
		spans = tracingtest.NewRecorder()
		defer spans.Shutdown()
		tp = spans.Provider
	}

	// The pipeline runs in the background: a relay and two consumers. If
	// one of them fails, waiting stops (bg.Ctx).
	bg := setup.NewBackground(ctx)
	defer func() { err = errors.Join(err, bg.Stop()) }()

	relay, err := producer.NewRelay(ctx, relayDB, producer.RelayConfig{
		Schema:  cfg.Schema,
		Brokers: k.Brokers,
		Logger:  log,
		Metrics: relayMetrics,
		// Tracing: a "send" span per event, continuing the trace that
		// PublishTx captured in the row.
		TracerProvider: tp,
	})
	if err != nil {
		return err
	}
	bg.Go(relay.Run)

	for _, g := range groups {
		c, err := consumer.New(consumerDB[g.name], consumer.Config{
			Config: middleware.Config{
				Group:          groupID[g.name],
				Schema:         cfg.Schema,
				Logger:         log,
				Metrics:        consumerMetrics,
				TracerProvider: tp,
			},
			Brokers: k.Brokers,
			Topics:  []string{topic},
		})
		if err != nil {
			return err
		}
		if err := consumer.HandleJSON(c, "order.created", g.handler(pgx.Identifier{cfg.Schema, g.table}.Sanitize())); err != nil {
			return err
		}
		bg.Go(c.Run)
	}

	counter := func(name, group string) int {
		var labels map[string]string
		if group != "" {
			labels = map[string]string{"group": group}
		}
		return int(setup.Counter(reg, name, labels))
	}
	progress := func(stage string) {
		fmt.Fprintf(stdout, "progress stage=%s forwarded=%d billing_applied=%d shipping_applied=%d duplicates_skipped=%d elapsed=%s\n", stage,
			counter("eventline_relay_forwarded_total", ""),
			counter("eventline_consumer_events_applied_total", groupID["billing"]),
			counter("eventline_consumer_events_applied_total", groupID["shipping"]),
			counter("eventline_consumer_events_duplicate_total", ""),
			time.Since(start).Round(time.Millisecond))
	}

	// 1. Create the orders, each order row with its event in one
	// transaction.
	p, err := producer.New(ctx, db, producer.Config{Schema: cfg.Schema, DefaultTopic: topic, Propagator: tracing.DefaultPropagator()})
	if err != nil {
		return err
	}
	events, err := createOrders(ctx, db, p, cfg, tp)
	if err != nil {
		return err
	}
	progress("created")

	// 2. Deliver some events a second time, as a relay that crashed before
	// recording its progress would: the same record, same event id, once
	// more on the topic.
	var again []eventline.Event
	for i, e := range events {
		if cfg.RedeliverEvery > 0 && (i+1)%cfg.RedeliverEvery == 0 {
			again = append(again, e)
		}
	}
	if err := setup.PublishEvents(k.Brokers, topic, again); err != nil {
		return err
	}
	republished, redelivered := len(again), len(again)*len(groups)
	progress("republished")

	// 3. Wait until each group has handled every delivery: each event,
	// and each second copy.
	lastProgress := time.Now()
	err = setup.WaitFor(bg.Ctx, 5*time.Minute, "the consumers to handle every delivery", func() (bool, error) {
		if cfg.Progress > 0 && time.Since(lastProgress) >= cfg.Progress {
			progress("consuming")
			lastProgress = time.Now()
		}
		for _, g := range groups {
			handled := counter("eventline_consumer_events_applied_total", groupID[g.name]) + counter("eventline_consumer_events_duplicate_total", groupID[g.name])
			if handled < len(events)+republished {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return err
	}
	if err := bg.Stop(); err != nil {
		return err
	}

	// 4. Check the outcome in the database, not in the counters.
	applied := map[string]int{}
	for _, g := range groups {
		n, err := checkAppliedOnce(ctx, db, cfg.Schema, g.table, len(events))
		if err != nil {
			return fmt.Errorf("consumer group %s: %w", g.name, err)
		}
		applied[g.name] = n
	}
	st, err := admin.ReadOutboxStatus(ctx, db, cfg.Schema)
	if err != nil {
		return err
	}
	if st.Backlog() != 0 || st.DeadLetters != 0 {
		return fmt.Errorf("the outbox still holds %d events and %d dead letters", st.Backlog(), st.DeadLetters)
	}
	forwarded := counter("eventline_relay_forwarded_total", "")
	duplicates := counter("eventline_consumer_events_duplicate_total", "")
	fmt.Fprintf(stdout, "orders=%d forwarded=%d republished=%d redelivered=%d billing_applied=%d shipping_applied=%d duplicates_skipped=%d elapsed=%s\n",
		len(events), forwarded, republished, redelivered, applied["billing"], applied["shipping"], duplicates, time.Since(start).Round(time.Millisecond))
	if forwarded != len(events) {
		return fmt.Errorf("the relay forwarded %d events, want %d", forwarded, len(events))
	}
	if duplicates != redelivered {
		return fmt.Errorf("the consumers skipped %d duplicates, want %d: one per group for each republished record", duplicates, redelivered)
	}
	if spans != nil {
		return printTrace(stdout, spans, events, cfg.RedeliverEvery)
	}
	return nil
}

// printTrace prints the spans of one order, the first that was delivered
// twice (or the first), as an indented tree.
func printTrace(w io.Writer, spans *tracingtest.Recorder, events []eventline.Event, redeliverEvery int) error {
	i := 0
	if redeliverEvery > 0 && redeliverEvery <= len(events) {
		i = redeliverEvery - 1
	}
	e := events[i]
	parts := strings.Split(e.TraceParent, "-")
	if len(parts) != 4 {
		return fmt.Errorf("order %s carries no trace (traceparent %q)", e.AggregateID, e.TraceParent)
	}
	id, err := trace.TraceIDFromHex(parts[1])
	if err != nil {
		return fmt.Errorf("order %s: traceparent %q: %w", e.AggregateID, e.TraceParent, err)
	}
	own := spans.Trace(id)
	// order_no is A-<n> for the n-th order created (see createOrders).
	fmt.Fprintf(w, "trace order=A-%06d event_id=%s event_type=%s aggregate=%s/%s spans=%d\n", i+1, e.ID, e.Type, e.AggregateType, e.AggregateID, len(own))
	// Attributes this line or the span names already say are left out.
	fmt.Fprint(w, tracingtest.Tree(own, "messaging.system", "messaging.destination.name", "messaging.operation.name", "messaging.operation.type",
		"messaging.message.id", "eventline.event.type", "eventline.aggregate.type", "eventline.aggregate.id", "messaging.kafka.message.key"))
	return nil
}

// createOrders creates cfg.Orders orders in cfg.Writers concurrent
// transactions and returns their events, in order.
func createOrders(ctx context.Context, db *pgxpool.Pool, p *producer.Producer, cfg config, tp trace.TracerProvider) ([]eventline.Event, error) {
	writers, ctx := errgroup.WithContext(ctx)
	events := make([]eventline.Event, cfg.Orders)
	next := make(chan int)
	for range cfg.Writers {
		writers.Go(func() error {
			for i := range next {
				e, err := createOrder(ctx, db, p, tp, cfg.Schema, fmt.Sprintf("A-%06d", i+1), int64(1000+i%9000))
				if err != nil {
					return err
				}
				events[i] = e
			}
			return nil
		})
	}
feed:
	for i := range events {
		select {
		case next <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	return events, writers.Wait()
}

// createOrder inserts an order and writes its order.created event into the
// outbox in the same transaction: both commit, or neither does.
//
// With tracing, the transaction runs in a "create order" span: PublishTx
// captures it in the event (its traceparent), and the relay and the
// consumers continue that trace.
func createOrder(ctx context.Context, db *pgxpool.Pool, p *producer.Producer, tp trace.TracerProvider, schema, orderNo string, amount int64) (eventline.Event, error) {
	if tp != nil {
		var span trace.Span
		ctx, span = tp.Tracer("orders").Start(ctx, "create order "+orderNo)
		defer span.End()
	}
	var e eventline.Event
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO `+pgx.Identifier{schema, "orders"}.Sanitize()+` (order_no, amount_cents) VALUES ($1, $2) RETURNING id`,
			orderNo, amount).Scan(&id)
		if err != nil {
			return fmt.Errorf("insert order: %w", err)
		}
		e, err = eventline.NewJSONEvent("order.created", "order", fmt.Sprint(id), OrderCreated{OrderID: id, OrderNo: orderNo, AmountCents: amount})
		if err != nil {
			return err
		}
		// Set here rather than left to the producer, so that the very same
		// event can be sent again later.
		e.ID, e.AggregateVersion, e.OccurredAt = eventline.NewEventID(), 1, time.Now()
		// Likewise the trace context, which PublishTx would capture.
		e.TraceParent = traceParent(ctx)
		return p.PublishTx(ctx, tx, e)
	})
	return e, err
}

// checkAppliedOnce checks that table holds exactly one row per order and
// returns its row count.
func checkAppliedOnce(ctx context.Context, db *pgxpool.Pool, schema, table string, orders int) (int, error) {
	effects, all := pgx.Identifier{schema, table}.Sanitize(), pgx.Identifier{schema, "orders"}.Sanitize()
	var rows, distinct, missing int
	err := db.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM `+effects+`),
			(SELECT count(DISTINCT order_id) FROM `+effects+`),
			(SELECT count(*) FROM `+all+` o WHERE NOT EXISTS (SELECT 1 FROM `+effects+` t WHERE t.order_id = o.id))`).
		Scan(&rows, &distinct, &missing)
	if err != nil {
		return 0, err
	}
	if rows != orders || distinct != orders || missing != 0 {
		return rows, fmt.Errorf("%s has %d rows for %d distinct orders, %d orders have none; want exactly one per order (%d)", table, rows, distinct, missing, orders)
	}
	return rows, nil
}

// traceParent is the W3C traceparent of the span in ctx, or "".
func traceParent(ctx context.Context) string {
	c := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, c)
	return c[eventline.MetaTraceParent]
}

func kafkaName(k *setup.Kafka) string {
	if k.InProcess() {
		return "in-process"
	}
	return fmt.Sprint(k.Brokers)
}
