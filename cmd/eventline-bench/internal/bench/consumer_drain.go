package bench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
)

// consumerVersions is the number of versions per aggregate in the
// consumer backlog.
const consumerVersions = 25

// effectsDDL is the consumer's business table: one row per applied event.
const effectsDDL = `CREATE TABLE %s (
	id           bigserial PRIMARY KEY,
	event_id     text      NOT NULL,
	aggregate_id text      NOT NULL,
	version      bigint    NOT NULL,
	payload      jsonb     NOT NULL)`

const insertEffectSQL = `INSERT INTO %s (event_id, aggregate_id, version, payload) VALUES ($1, $2, $3, $4)`

// business is the handler's work, the same in every variant: one insert.
type business struct{ insert string }

func (b business) apply(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
	_, err := tx.Exec(ctx, b.insert, e.ID, e.AggregateID, e.AggregateVersion, e.Payload)
	return err
}

// runConsumerDrain consumes one prefilled topic with a bare handler and
// with the same handler behind eventline's middleware, each in its own
// consumer group and schema.
func runConsumerDrain(ctx context.Context, e *env) (Result, error) {
	n := e.sizes.ConsumerBacklog
	k, err := e.kafka()
	if err != nil {
		return Result{}, err
	}
	defer k.close()
	topic, err := k.topic("consumer")
	if err != nil {
		return Result{}, err
	}
	aggregates := max(n/consumerVersions, 1)
	if err := e.prefillConsumer(ctx, k, topic, n, aggregates); err != nil {
		return Result{}, err
	}

	// Rounds alternate the variants, each round in fresh consumer groups
	// and schemas reading the whole topic again, so drift in the machine's
	// load hits all of them.
	var bare, bareBatched, ours, single, runner drainResult
	for round := 1; round <= e.sizes.ConsumerRounds; round++ {
		e.progressf("   round %d/%d", round, e.sizes.ConsumerRounds)
		d, err := e.consumeBare(ctx, k, topic, n, round)
		if err != nil {
			return Result{}, fmt.Errorf("bare handler: %w", err)
		}
		bare = bare.add(d)
		if d, err = e.consumeBareBatched(ctx, k, topic, n, round); err != nil {
			return Result{}, fmt.Errorf("bare batching handler: %w", err)
		}
		bareBatched = bareBatched.add(d)
		if d, err = e.consumeMiddleware(ctx, k, topic, n, round); err != nil {
			return Result{}, fmt.Errorf("eventline middleware: %w", err)
		}
		ours = ours.add(d)
		if d, err = e.consumeRunner(ctx, k, topic, n, runnerVariant{
			group: fmt.Sprintf("bench-runner1-%d", round), schema: "consumer_runner1", lanes: 1, batch: 1,
			label: "eventline runner, one event per tx", profile: "consumer_drain.runner_single",
		}); err != nil {
			return Result{}, fmt.Errorf("eventline consumer runner (one event per tx): %w", err)
		}
		single = single.add(d)
		if d, err = e.consumeRunner(ctx, k, topic, n, runnerVariant{
			group: fmt.Sprintf("bench-runner-%d", round), schema: "consumer_runner",
			label: "eventline runner, lanes + batches", profile: "consumer_drain.runner",
		}); err != nil {
			return Result{}, fmt.Errorf("eventline consumer runner: %w", err)
		}
		runner = runner.add(d)
	}
	base := "bare handler: insert in its own tx (watermill-kafka + Router)"
	baseBatched := fmt.Sprintf("bare handler batching the same way (Sarama group, %d lanes × batches of %d, one tx per batch), no dedup/gate", consumer.DefaultLanes, consumer.DefaultBatchSize)
	defaults := fmt.Sprintf("consume events/s, consumer.New runner (defaults: %d lanes × batches of %d)", consumer.DefaultLanes, consumer.DefaultBatchSize)
	res := Result{
		Rows: []Row{
			{Metric: "consume events/s, middleware (tx ▸ dedup ▸ gate)", Ours: ours.rate(), Base: bare.rate(), Baseline: base, Target: "≥ 0.80"},
			{Metric: "consume events/s, consumer.New runner, Lanes 1, BatchSize 1", Ours: single.rate(), Base: bare.rate(), Baseline: base},
			{Metric: defaults, Ours: runner.rate(), Base: bare.rate(), Baseline: base, Target: "≥ 2.00 " + issue10},
			{Metric: defaults, Ours: runner.rate(), Base: bareBatched.rate(), Baseline: baseBatched, Target: "≥ 0.80 " + issue10},
		},
		Notes: []string{
			fmt.Sprintf("%d events over %d aggregates × %d consecutive versions, %d partitions keyed by aggregate, prefilled; each variant reads the whole topic from the start in its own consumer group and schema, %d round(s), alternating; the clock runs from the first handled message to the last commit; watermill-kafka handles one message per partition at a time (%d in flight); every variant has a pool of %d connections",
				n, aggregates, consumerVersions, Partitions, e.sizes.ConsumerRounds, Partitions, Partitions+4),
		},
	}
	if n < FullSizes().ConsumerBacklog {
		res.Notes = append(res.Notes, fmt.Sprintf("reduced backlog (%d instead of %d)", n, FullSizes().ConsumerBacklog))
	}
	res.Ratios = []Ratio{
		{Name: "consumer_drain_throughput", Value: res.Rows[0].Ratio()},
		{Name: "consumer_drain_throughput_runner_single", Value: res.Rows[1].Ratio()},
		{Name: "consumer_drain_throughput_runner", Value: res.Rows[2].Ratio()},
		{Name: "consumer_drain_throughput_runner_vs_bare_batched", Value: res.Rows[3].Ratio()},
	}
	return res, nil
}

// prefillConsumer writes n events over the given number of aggregates to
// topic, keyed by aggregate, round robin over the aggregates, each
// aggregate's versions consecutive.
func (e *env) prefillConsumer(ctx context.Context, k *kafkaEnv, topic string, n, aggregates int) error {
	events := make([]eventline.Event, n)
	versions := make([]int64, aggregates)
	now := time.Now()
	for i := range events {
		a := i % aggregates
		versions[a]++
		ev := orderCreated(fmt.Sprintf("order-%d", a), i)
		ev.AggregateVersion = versions[a]
		events[i] = ev.WithDefaults(now)
	}
	msgs, err := encode(events)
	if err != nil {
		return err
	}
	t0 := time.Now()
	if err := k.fill(ctx, topic, msgs); err != nil {
		return err
	}
	e.progressf("   prefilled %s with %d events in %s", topic, n, time.Since(t0).Round(time.Millisecond))
	return nil
}

// consumerPool opens the consumer's pool: one connection per partition and
// a few spare.
func (e *env) consumerPool(ctx context.Context) (*pgxpool.Pool, error) {
	return e.warmPool(ctx, Partitions+4)
}

// warmPool opens a pool and connects all its connections before the clock
// starts: a consumer in production runs on a warm pool, and on a loaded
// machine opening 16 connections at once takes long enough to hide what is
// measured.
func (e *env) warmPool(ctx context.Context, conns int32) (*pgxpool.Pool, error) {
	pool, err := e.openPool(ctx, conns, nil)
	if err != nil {
		return nil, err
	}
	held := make([]*pgxpool.Conn, 0, conns)
	var err2 error
	for range conns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			err2 = fmt.Errorf("warm the consumer pool: %w", err)
			break
		}
		held = append(held, c)
	}
	for _, c := range held {
		c.Release()
	}
	if err2 != nil {
		pool.Close()
		return nil, err2
	}
	return pool, nil
}

// progressCounter counts messages whose handling succeeded (outermost, so
// after the commit) and remembers when the first one started.
type progressCounter struct {
	done  atomic.Int64
	first atomic.Int64 // unix nanoseconds
}

func (c *progressCounter) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		c.first.CompareAndSwap(0, time.Now().UnixNano())
		out, err := h(msg)
		if err == nil {
			c.done.Add(1)
		}
		return out, err
	}
}

// drain times the counter reaching n, from the first message on.
func (e *env) drainConsumer(ctx context.Context, label, profile string, n int, c *progressCounter, start func() error) (drainResult, error) {
	stopProfile := e.profile(profile)
	defer stopProfile()
	if err := start(); err != nil {
		return drainResult{}, err
	}
	stopWatch := e.watch(label, n, c.done.Load)
	end, err := waitFor(ctx, drainTimeout(n), int64(n), c.done.Load)
	stopWatch()
	if err != nil {
		return drainResult{}, err
	}
	d := drainResult{events: n, elapsed: end.Sub(time.Unix(0, c.first.Load()))}
	e.progressf("   %s: %d events in %s = %.0f events/s", label, n, d.elapsed.Round(time.Millisecond), d.rate())
	return d, nil
}

// routerConsumer runs a watermill-kafka subscriber and a Router with one
// handler behind mw.
func (e *env) routerConsumer(ctx context.Context, k *kafkaEnv, topic, group string, mw []message.HandlerMiddleware, h message.NoPublishHandlerFunc) (stop func() error, err error) {
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               k.brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: kafkaconf.Consumer("bench-" + group),
		ConsumerGroup:         group,
	}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	router.AddMiddleware(mw...)
	router.AddConsumerHandler("bench/"+group, topic, sub, h)
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-done:
		return nil, fmt.Errorf("router stopped at start: %w", err)
	}
	return func() error {
		err := router.Close()
		if rerr := <-done; err == nil {
			err = rerr
		}
		return err
	}, nil
}

// consumerSchema creates the variant's schema (with eventline's migrations
// when migrated) and its effects table.
func (e *env) consumerSchema(ctx context.Context, prefix string, migrated bool) (string, business, func(), error) {
	var schema string
	var drop func()
	var err error
	if migrated {
		schema, drop, err = e.newEventlineSchema(ctx, prefix, 1)
	} else {
		schema, drop, err = e.newSchema(ctx, prefix)
	}
	if err != nil {
		return "", business{}, nil, err
	}
	effects := sqlident.Qualify(schema, "effects")
	if err := e.exec(ctx, fmt.Sprintf(effectsDDL, effects)); err != nil {
		drop()
		return "", business{}, nil, err
	}
	return schema, business{insert: fmt.Sprintf(insertEffectSQL, effects)}, drop, nil
}

// checkEffects verifies every event was applied exactly once.
func (e *env) checkEffects(ctx context.Context, schema string, n int) error {
	var got, distinct int
	err := e.admin.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM `+sqlident.Qualify(schema, "effects")).Scan(&got, &distinct)
	if err != nil {
		return err
	}
	if got != n || distinct != n {
		return fmt.Errorf("%d effects (%d distinct events), want %d", got, distinct, n)
	}
	return nil
}

func (e *env) consumeBare(ctx context.Context, k *kafkaEnv, topic string, n, round int) (drainResult, error) {
	return e.consumeWithRouter(ctx, k, topic, n, routerVariant{
		group: fmt.Sprintf("bench-bare-%d", round), schema: "consumer_bare",
		label: "bare handler", profile: "consumer_drain.bare",
		build: func(pool *pgxpool.Pool, _ string, biz business) (message.HandlerMiddleware, message.NoPublishHandlerFunc, error) {
			return nil, func(msg *message.Message) error {
				ev, err := eventline.Decode(msg)
				if err != nil {
					return err
				}
				return pgx.BeginFunc(msg.Context(), pool, func(tx pgx.Tx) error { return biz.apply(msg.Context(), tx, ev) })
			}, nil
		},
	})
}

func (e *env) consumeMiddleware(ctx context.Context, k *kafkaEnv, topic string, n, round int) (drainResult, error) {
	group := fmt.Sprintf("bench-el-%d", round)
	return e.consumeWithRouter(ctx, k, topic, n, routerVariant{
		group: group, schema: "consumer_el", eventline: true,
		label: "eventline middleware", profile: "consumer_drain.middleware",
		build: func(pool *pgxpool.Pool, schema string, biz business) (message.HandlerMiddleware, message.NoPublishHandlerFunc, error) {
			el, err := middleware.New(middleware.Config{DB: pool, Group: group, Schema: schema, Logger: quiet})
			if err != nil {
				return nil, nil, err
			}
			return el.Middleware, func(msg *message.Message) error {
				tx, _ := middleware.TxFromContext(msg.Context())
				ev, _ := middleware.EventFromContext(msg.Context())
				return biz.apply(msg.Context(), tx, ev)
			}, nil
		},
	})
}

// routerVariant is a consumer_drain variant that runs a handler on a plain
// watermill-kafka subscriber and Router.
type routerVariant struct {
	group, schema, label, profile string
	eventline                     bool // migrate eventline's tables, and check the gate afterwards
	// build returns the variant's middleware (nil for none) and handler.
	build func(pool *pgxpool.Pool, schema string, biz business) (message.HandlerMiddleware, message.NoPublishHandlerFunc, error)
}

func (e *env) consumeWithRouter(ctx context.Context, k *kafkaEnv, topic string, n int, v routerVariant) (drainResult, error) {
	schema, biz, drop, err := e.consumerSchema(ctx, v.schema, v.eventline)
	if err != nil {
		return drainResult{}, err
	}
	defer drop()
	pool, err := e.consumerPool(ctx)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	mw, handler, err := v.build(pool, schema, biz)
	if err != nil {
		return drainResult{}, err
	}
	var c progressCounter
	mws := []message.HandlerMiddleware{c.middleware}
	if mw != nil {
		mws = append(mws, mw)
	}
	var stop func() error
	d, err := e.drainConsumer(ctx, v.label, v.profile, n, &c, func() (err error) {
		stop, err = e.routerConsumer(ctx, k, topic, v.group, mws, handler)
		return err
	})
	if stop != nil {
		if serr := stop(); err == nil {
			err = serr
		}
	}
	if err != nil {
		return d, err
	}
	if v.eventline {
		if err := e.checkGate(ctx, schema, n); err != nil {
			return d, err
		}
	}
	return d, e.checkEffects(ctx, schema, n)
}

// runnerVariant is a consumer_drain (or consumer_slow_handler) variant
// that runs consumer.New's ready runner.
type runnerVariant struct {
	group, schema, label, profile string
	// lanes and batch are Config.Lanes and Config.BatchSize (0: defaults).
	lanes, batch int
	// conns is the pool size (0: consumerPool's).
	conns int32
	// slow, when set, is how long the handler waits per event (an external
	// call) before its insert.
	slow time.Duration
}

func (e *env) consumeRunner(ctx context.Context, k *kafkaEnv, topic string, n int, v runnerVariant) (drainResult, error) {
	schema, biz, drop, err := e.consumerSchema(ctx, v.schema, true)
	if err != nil {
		return drainResult{}, err
	}
	defer drop()
	conns := v.conns
	if conns == 0 {
		conns = Partitions + 4
	}
	pool, err := e.warmPool(ctx, conns)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	var c progressCounter
	cons, err := consumer.New(pool, consumer.Config{
		Brokers: k.brokers, Group: v.group, Topics: []string{topic}, Schema: schema,
		Lanes: v.lanes, BatchSize: v.batch,
		Middleware: []message.HandlerMiddleware{c.middleware}, Logger: quiet,
	})
	if err != nil {
		return drainResult{}, err
	}
	handle := biz.apply
	if v.slow > 0 {
		handle = func(ctx context.Context, tx pgx.Tx, ev eventline.Event) error {
			select {
			case <-time.After(v.slow):
			case <-ctx.Done():
				return ctx.Err()
			}
			return biz.apply(ctx, tx, ev)
		}
	}
	if err := cons.Handle("order.created", handle); err != nil {
		return drainResult{}, err
	}
	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var runErr error
	d, err := e.drainConsumer(ctx, v.label, v.profile, n, &c, func() error {
		wg.Add(1)
		go func() { defer wg.Done(); runErr = cons.Run(rctx) }()
		return nil
	})
	cancel()
	wg.Wait()
	if err == nil {
		err = runErr
	}
	if err != nil {
		return d, err
	}
	if err := e.checkGate(ctx, schema, n); err != nil {
		return d, err
	}
	return d, e.checkEffects(ctx, schema, n)
}

// checkGate verifies the gate applied everything in order: nothing parked,
// every event recorded once.
func (e *env) checkGate(ctx context.Context, schema string, n int) error {
	var parked, processed int
	err := e.admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+sqlident.Qualify(schema, "parked_events")+`),
		(SELECT count(*) FROM `+sqlident.Qualify(schema, "processed_events")+`)`).Scan(&parked, &processed)
	if err != nil {
		return err
	}
	if parked != 0 || processed != n {
		return fmt.Errorf("gate state: %d parked, %d processed, want 0 and %d", parked, processed, n)
	}
	return nil
}
