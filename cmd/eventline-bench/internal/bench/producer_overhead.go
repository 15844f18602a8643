package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
)

// ordersDDL is the business table every producer-side scenario writes to.
const ordersDDL = `CREATE TABLE %s (
	id           bigserial   PRIMARY KEY,
	customer_id  text        NOT NULL,
	amount_cents bigint      NOT NULL,
	created_at   timestamptz NOT NULL DEFAULT now())`

const insertOrderSQL = `INSERT INTO %s (customer_id, amount_cents) VALUES ($1, $2) RETURNING id`

// orderPayload is the body of every benchmark event: a small order, about
// 200 bytes of JSON.
func orderPayload(orderID int64, seq int) []byte {
	b, _ := json.Marshal(map[string]any{
		"order_id": orderID, "customer_id": "customer-" + strconv.Itoa(seq%997), "amount_cents": 1000 + seq%5000,
		"currency": "EUR", "items": []map[string]any{{"sku": "sku-" + strconv.Itoa(seq%113), "qty": 1 + seq%3}},
		"note": "benchmark order",
	})
	return b
}

// orderCreated is the event a business transaction publishes for an order.
func orderCreated(aggregateID string, seq int) eventline.Event {
	return eventline.Event{
		Type: "order.created", AggregateType: "order", AggregateID: aggregateID,
		Payload: orderPayload(int64(seq), seq),
	}
}

// publishFunc writes one event in the business transaction.
type publishFunc func(ctx context.Context, tx pgx.Tx, ev eventline.Event) error

// writeMode is how a business transaction writes its event: publish in
// the transaction (nil: no event), or, with commit set, through
// commit.PublishAndCommit, which sends the outbox statement with COMMIT.
type writeMode struct {
	publish publishFunc
	commit  *producer.Producer
}

// runProducerOverhead compares a business transaction (insert one order,
// commit) with the same transaction plus PublishTx of one event, under
// Sizes.Producers concurrent producers. Two more variants put the figure in
// context: the same transaction writing the event to plain Watermill's
// outbox (watermill-sql through forwarder.NewPublisher), and PublishTx with
// the outbox tables' NOTIFY trigger disabled (diagnostic). Variants
// alternate in every round so drift hits all of them.
func runProducerOverhead(ctx context.Context, e *env) (Result, error) {
	sz := e.sizes
	schema, drop, err := e.newEventlineSchema(ctx, "producer", migrations.DefaultShards)
	if err != nil {
		return Result{}, err
	}
	defer drop()
	plain, dropPlain, err := e.newPlainOutbox(ctx, "producer_plain")
	if err != nil {
		return Result{}, err
	}
	defer dropPlain()
	orders := qualify(schema, "orders")
	if err := e.exec(ctx, fmt.Sprintf(ordersDDL, orders)); err != nil {
		return Result{}, err
	}
	q := newQueryCounter()
	pool, err := e.openPool(ctx, int32(sz.Producers)+2, q)
	if err != nil {
		return Result{}, err
	}
	defer pool.Close()
	prod, err := producer.New(ctx, pool, producer.Config{Schema: schema, DefaultTopic: "orders.events", Logger: quiet})
	if err != nil {
		return Result{}, err
	}
	// The same producer, told that order versions are the caller's: each
	// transaction creates its order, so the order is at version 1 and no
	// other transaction can write it before this one commits.
	callers, err := producer.New(ctx, pool, producer.Config{Schema: schema, DefaultTopic: "orders.events", Logger: quiet, CallerVersionedTypes: []string{"order"}})
	if err != nil {
		return Result{}, err
	}
	w := &orderWriter{pool: pool, insert: fmt.Sprintf(insertOrderSQL, orders)}
	publishTx := func(ctx context.Context, tx pgx.Tx, ev eventline.Event) error { return prod.PublishTx(ctx, tx, ev) }
	publishCallers := func(ctx context.Context, tx pgx.Tx, ev eventline.Event) error {
		ev.AggregateVersion = 1
		return callers.PublishTx(ctx, tx, ev)
	}
	publishPlain := func(_ context.Context, tx pgx.Tx, ev eventline.Event) error {
		ev.AggregateVersion = 1
		msg, err := eventline.Encode(ev)
		if err != nil {
			return err
		}
		return plain.publish(tx, "orders.events", msg)
	}

	variants := []*struct {
		name, profile string
		publish       writeMode
		notify        bool
		lat           latencies
		n             int64
		t             time.Duration
		cost          Cost
	}{
		{name: "business tx alone", profile: "producer_overhead.bare", notify: true},
		{name: "+ PublishTx", profile: "producer_overhead.publishtx", publish: writeMode{publish: publishTx}, notify: true},
		{name: "+ plain Watermill outbox", profile: "producer_overhead.plain", publish: writeMode{publish: publishPlain}, notify: true},
		{name: "+ PublishTx, no NOTIFY", profile: "producer_overhead.publishtx_nonotify", publish: writeMode{publish: publishTx}},
		{name: "PublishAndCommit", profile: "producer_overhead.publishandcommit", publish: writeMode{commit: prod}, notify: true},
		{name: "+ PublishTx, caller's versions", profile: "producer_overhead.publishtx_callers", publish: writeMode{publish: publishCallers}, notify: true},
	}
	notifying := true
	setNotify := func(on bool) error {
		if on == notifying {
			return nil
		}
		verb := "DISABLE"
		if on {
			verb = "ENABLE"
		}
		for shard := range migrations.DefaultShards {
			// The migrations name each shard's messages table outbox_<shard>.
			table := qualify(schema, "outbox_"+strconv.Itoa(shard))
			if err := e.exec(ctx, fmt.Sprintf(`ALTER TABLE %s %s TRIGGER USER`, table, verb)); err != nil {
				return err
			}
		}
		notifying = on
		return nil
	}
	defer func() { _ = setNotify(true) }()

	// Cold start: the first transaction on each of Producers new
	// connections at once (connect, prepare, first plans), the business
	// transaction alone and with PublishTx, each on a pool of its own.
	coldBare, err := e.coldProducers(ctx, w.insert, writeMode{})
	if err != nil {
		return Result{}, fmt.Errorf("cold start: %w", err)
	}
	coldOurs, err := e.coldProducers(ctx, w.insert, writeMode{publish: publishTx})
	if err != nil {
		return Result{}, fmt.Errorf("cold start: %w", err)
	}
	e.progressf("   cold start, first tx per new connection: business tx alone %s; + PublishTx %s", coldBare, coldOurs)

	// Warm-up: every connection of the pool runs every variant's
	// transaction warmRuns times per outbox shard, twice over
	// (connections open, statements prepared, past PostgreSQL's first
	// custom plans: eventline's statements are one per shard, and each
	// transaction's order lands in a shard by its id).
	runs := 2 * warmRuns * migrations.DefaultShards
	e.progressf("   warm-up: %d connections × %d variants × %d", pool.Config().MaxConns, len(variants), runs)
	if err := onEveryConn(ctx, pool, func(ctx context.Context, c *pgxpool.Conn) error {
		for range runs {
			for _, v := range variants {
				if _, err := w.tx(ctx, c, v.publish); err != nil {
					return err
				}
			}
		}
		return nil
	}); err != nil {
		return Result{}, err
	}
	for round := 0; round < sz.Rounds; round++ {
		for _, v := range alternate(variants, round) {
			if err := setNotify(v.notify); err != nil {
				return Result{}, err
			}
			m, err := e.startMeter(ctx, "producer", v.name, []string{schema, plain.schema}, []*pgxpool.Pool{pool}, q)
			if err != nil {
				return Result{}, err
			}
			stop := func() {}
			if round == 0 {
				stop = e.profile(v.profile)
			}
			start := time.Now()
			count, err := w.phase(ctx, sz.Producers, sz.ProducerPhase, v.publish, &v.lat)
			elapsed := time.Since(start)
			v.t += elapsed
			stop()
			if err != nil {
				return Result{}, fmt.Errorf("%s: %w", v.name, err)
			}
			v.n += count
			cost, err := m.stop(ctx, count, float64(count)/elapsed.Seconds())
			if err != nil {
				return Result{}, err
			}
			v.cost = v.cost.add(cost)
			e.progressf("   round %d/%d %-26s %6.0f tx/s", round+1, sz.Rounds, v.name, float64(count)/elapsed.Seconds())
			e.logCost(cost)
		}
	}
	sum := make([]summary, len(variants))
	for i, v := range variants {
		sum[i] = v.lat.summary()
		e.progressf("   %-26s %s", v.name, sum[i])
		v.cost.Rate = float64(v.n) / v.t.Seconds()
	}
	tps := func(i int) float64 { return float64(variants[i].n) / variants[i].t.Seconds() }
	bare, ours, pl, quietNotify, pac, callersSum := sum[0], sum[1], sum[2], sum[3], sum[4], sum[5]
	base := "business tx alone (insert 1 order, commit)"
	plainBase := "same tx writing the event to plain Watermill's outbox"
	res := Result{
		Rows: []Row{
			{Metric: "tx latency mean, ms", Ours: millis(ours.mean), Base: millis(bare.mean), Baseline: base, Target: "≤ 1.25; ≤ 1.50 " + issue10},
			{Metric: "tx latency p99, ms", Ours: millis(ours.p99), Base: millis(bare.p99), Baseline: base},
			{Metric: fmt.Sprintf("throughput, tx/s (%d producers)", sz.Producers), Ours: tps(1), Base: tps(0), Baseline: base},
			{Metric: "tx latency mean, ms", Ours: millis(ours.mean), Base: millis(pl.mean), Baseline: plainBase, Target: "≤ 1.10 " + issue10},
			{Metric: "tx latency mean, ms, NOTIFY trigger off (diagnostic)", Ours: millis(quietNotify.mean), Base: millis(bare.mean), Baseline: base},
			{Metric: "round trips per tx", Ours: variants[1].cost.RoundTripsPerEvent(), Base: variants[2].cost.RoundTripsPerEvent(), Baseline: plainBase},
			{Metric: "tx latency mean, ms, PublishAndCommit (outbox statement sent with COMMIT)", Ours: millis(pac.mean), Base: millis(pl.mean), Baseline: plainBase, Target: "≤ 1.10 (issue 20)"},
			{Metric: "round trips per tx, PublishAndCommit", Ours: variants[4].cost.RoundTripsPerEvent(), Base: variants[2].cost.RoundTripsPerEvent(), Baseline: plainBase},
			{Metric: "tx latency mean, ms, PublishTx with the caller's versions (no sequence row)", Ours: millis(callersSum.mean), Base: millis(pl.mean), Baseline: plainBase},
			{Metric: fmt.Sprintf("cold start: first tx on each of %d new connections, mean ms", sz.Producers), Ours: millis(coldOurs.mean), Base: millis(coldBare.mean), Baseline: base},
		},
		Notes: []string{
			fmt.Sprintf("%d concurrent producers in closed loops, %d round(s) of %s per variant, alternating; each tx inserts one order row; PublishTx adds one event in one statement: its version allocated from aggregate_sequences and one outbox row in one of %d shards (whose statement trigger NOTIFYs only a relay that waits idle, so never here); no relay running",
				sz.Producers, sz.Rounds, sz.ProducerPhase, migrations.DefaultShards),
			"plain Watermill row: the same event written with watermill-sql's publisher wrapped in forwarder.NewPublisher (one INSERT, no version, no NOTIFY)",
			fmt.Sprintf("measured on a warm pool: before the rounds every one of its %d connections ran every variant's transaction %d times; the cold start row is the first transaction on each of %d new connections at once, on a pool of its own per variant", sz.Producers+2, warmRuns, sz.Producers),
			"costs (cost table) are per transaction over the measured phases, on the producers' pool; rows and WAL of the eventline and plain Watermill schemas",
			"PublishAndCommit row: the same transaction through producer.PublishAndCommit, which sends the outbox statement with COMMIT in one round trip",
			"caller's versions row: PublishTx of a producer with Config.CallerVersionedTypes = order, the event at version 1 (the transaction creates the order): the outbox row alone, no aggregate_sequences row",
			"diagnostic row: PublishTx with the outbox tables' trigger disabled (ALTER TABLE … DISABLE TRIGGER USER), i.e. the cost of its outbox_waiting check; the trigger NOTIFYs only idle relays because PostgreSQL serializes the commits of transactions that sent a NOTIFY (a database-wide lock held through the commit's WAL flush), which defeats group commit",
		},
	}
	res.Ratios = []Ratio{
		{Name: "producer_overhead_latency", Value: res.Rows[0].Ratio()},
		{Name: "producer_overhead_latency_p99", Value: res.Rows[1].Ratio()},
		{Name: "producer_overhead_latency_vs_plain_watermill", Value: res.Rows[3].Ratio()},
		{Name: "producer_overhead_latency_without_notify", Value: res.Rows[4].Ratio()},
		{Name: "producer_overhead_round_trips_per_event_vs_plain_watermill", Value: res.Rows[5].Ratio()},
		{Name: "producer_overhead_latency_publishandcommit_vs_plain_watermill", Value: res.Rows[6].Ratio()},
		{Name: "producer_overhead_round_trips_per_event_publishandcommit_vs_plain_watermill", Value: res.Rows[7].Ratio()},
		{Name: "producer_overhead_latency_callers_versions_vs_plain_watermill", Value: res.Rows[8].Ratio()},
	}
	for _, v := range variants {
		res.Costs = append(res.Costs, v.cost)
	}
	return res, nil
}

// warmRuns is how many times a warm-up runs each statement on each
// connection: PostgreSQL plans a prepared statement anew for its first
// five executions before it may settle on a generic plan.
const warmRuns = 6

// coldProducers opens a pool of Producers+2 connections and runs the
// first transaction on Producers of them at once, and returns their
// latencies.
func (e *env) coldProducers(ctx context.Context, insert string, publish writeMode) (summary, error) {
	pool, err := e.openPool(ctx, int32(e.sizes.Producers)+2, nil)
	if err != nil {
		return summary{}, err
	}
	defer pool.Close()
	w := &orderWriter{pool: pool, insert: insert}
	var lat latencies
	var wg sync.WaitGroup
	errc := make(chan error, e.sizes.Producers)
	for range e.sizes.Producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			if _, err := w.tx(ctx, pool, publish); err != nil {
				errc <- err
				return
			}
			lat.add(time.Since(start))
		}()
	}
	wg.Wait()
	close(errc)
	if err := <-errc; err != nil {
		return summary{}, err
	}
	return lat.summary(), nil
}

// orderWriter runs business transactions, with or without an event.
type orderWriter struct {
	pool   *pgxpool.Pool
	insert string
	seq    atomic.Int64
}

// tx inserts one order through db (the writer's pool or one of its
// connections) and, as mode says, writes an order.created event for it in
// the same transaction. It returns the event (zero when mode writes none).
func (w *orderWriter) tx(ctx context.Context, db txBeginner, mode writeMode) (eventline.Event, error) {
	if mode.commit != nil {
		var ev eventline.Event
		written, err := mode.commit.PublishAndCommit(ctx, db, func(tx pgx.Tx) ([]eventline.Event, error) {
			seq := int(w.seq.Add(1))
			var id int64
			if err := tx.QueryRow(ctx, w.insert, "customer-"+strconv.Itoa(seq%997), 1000+seq%5000).Scan(&id); err != nil {
				return nil, fmt.Errorf("insert order: %w", err)
			}
			ev = orderCreated(strconv.FormatInt(id, 10), seq)
			ev.ID = eventline.NewEventID()
			return []eventline.Event{ev}, nil
		})
		if err != nil {
			return eventline.Event{}, fmt.Errorf("publish and commit: %w", err)
		}
		return written[0], nil
	}
	publish := mode.publish
	tx, err := db.Begin(ctx)
	if err != nil {
		return eventline.Event{}, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	seq := int(w.seq.Add(1))
	var id int64
	if err := tx.QueryRow(ctx, w.insert, "customer-"+strconv.Itoa(seq%997), 1000+seq%5000).Scan(&id); err != nil {
		return eventline.Event{}, fmt.Errorf("insert order: %w", err)
	}
	var ev eventline.Event
	if publish != nil {
		ev = orderCreated(strconv.FormatInt(id, 10), seq)
		ev.ID = eventline.NewEventID()
		if err := publish(ctx, tx, ev); err != nil {
			return eventline.Event{}, fmt.Errorf("publish: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return eventline.Event{}, err
	}
	return ev, nil
}

// phase runs n producers in closed loops for d and records each
// transaction's latency in lat (when not nil). It returns the count. The
// loops stop between transactions, so no connection is cut mid-query.
func (w *orderWriter) phase(ctx context.Context, n int, d time.Duration, publish writeMode, lat *latencies) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	deadline := time.Now().Add(d)
	var count atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && time.Now().Before(deadline) {
				start := time.Now()
				if _, err := w.tx(ctx, w.pool, publish); err != nil {
					errc <- err
					cancel()
					return
				}
				if lat != nil {
					lat.add(time.Since(start))
				}
				count.Add(1)
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errc:
		return 0, err
	default:
	}
	return count.Load(), nil
}
