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

// consumerVariant is one consumer_drain design.
type consumerVariant struct {
	name  string
	drain func(ctx context.Context, k *kafkaEnv, topic string, n, round int) (drainResult, error)
	sum   drainResult
}

// runConsumerDrain consumes one prefilled topic with bare handlers (one
// event per transaction through watermill-kafka's Router; one event per
// transaction and batches on the runner's lanes, with its offset rule) and
// with eventline (the middleware on the Router; the consumer.New runner,
// one event at a time and with its defaults), each in its own consumer
// group and schema.
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

	base := fmt.Sprintf("bare handler: insert in its own tx (watermill-kafka + Router, %d in flight)", Partitions)
	baseLaned := fmt.Sprintf("bare handler, one tx per event, on the runner's lanes (Sarama group, %d lanes per partition, lowest unfinished offset committed), no Router, no dedup/gate", consumer.DefaultLanes)
	baseBatched := fmt.Sprintf("bare handler batching the same way (Sarama group, %d lanes × batches of %d, one tx per batch, lowest unfinished offset committed), no Router, no dedup/gate", consumer.DefaultLanes, consumer.DefaultBatchSize)
	variants := []*consumerVariant{
		{name: base, drain: e.consumeBare},
		{name: baseLaned, drain: func(ctx context.Context, k *kafkaEnv, topic string, n, round int) (drainResult, error) {
			return e.consumeBareLaned(ctx, k, topic, n, round, 1)
		}},
		{name: baseBatched, drain: func(ctx context.Context, k *kafkaEnv, topic string, n, round int) (drainResult, error) {
			return e.consumeBareLaned(ctx, k, topic, n, round, consumer.DefaultBatchSize)
		}},
		{name: "eventline middleware", drain: e.consumeMiddleware},
		{name: "eventline runner, one event per tx", drain: func(ctx context.Context, k *kafkaEnv, topic string, n, round int) (drainResult, error) {
			return e.consumeRunner(ctx, k, topic, n, runnerVariant{
				group: fmt.Sprintf("bench-runner1-%d", round), schema: "consumer_runner1", lanes: 1, batch: 1,
				label: "eventline runner, one event per tx", profile: "consumer_drain.runner_single",
			})
		}},
		{name: "eventline runner, lanes + batches", drain: func(ctx context.Context, k *kafkaEnv, topic string, n, round int) (drainResult, error) {
			return e.consumeRunner(ctx, k, topic, n, runnerVariant{
				group: fmt.Sprintf("bench-runner-%d", round), schema: "consumer_runner",
				label: "eventline runner, lanes + batches", profile: "consumer_drain.runner",
			})
		}},
	}
	// Rounds alternate the variants, the order reversed every other round,
	// each round in fresh consumer groups and schemas reading the whole
	// topic again, so drift in the machine's load hits all of them.
	for round := 1; round <= e.sizes.ConsumerRounds; round++ {
		e.progressf("   round %d/%d", round, e.sizes.ConsumerRounds)
		for _, v := range alternate(variants, round-1) {
			d, err := v.drain(ctx, k, topic, n, round)
			if err != nil {
				return Result{}, fmt.Errorf("%s: %w", v.name, err)
			}
			v.sum = v.sum.add(d)
		}
	}
	bare, laned, batched, ours, single, runner := variants[0].sum, variants[1].sum, variants[2].sum, variants[3].sum, variants[4].sum, variants[5].sum
	defaults := fmt.Sprintf("consume events/s, consumer.New runner (defaults: %d lanes × batches of %d)", consumer.DefaultLanes, consumer.DefaultBatchSize)
	res := Result{
		Rows: []Row{
			{Metric: "consume events/s, middleware (tx ▸ dedup ▸ gate)", Ours: ours.rate(), Base: bare.rate(), Baseline: base, Target: "≥ 0.80"},
			{Metric: "consume events/s, consumer.New runner, Lanes 1, BatchSize 1", Ours: single.rate(), Base: bare.rate(), Baseline: base},
			{Metric: defaults, Ours: runner.rate(), Base: bare.rate(), Baseline: base, Target: "≥ 2.00 " + issue10},
			{Metric: defaults, Ours: runner.rate(), Base: batched.rate(), Baseline: baseBatched, Target: "≥ 0.80 " + issue10},
			{Metric: defaults, Ours: runner.rate(), Base: laned.rate(), Baseline: baseLaned},
			{Metric: "round trips per event, consumer.New runner (defaults)", Ours: runner.cost.RoundTripsPerEvent(), Base: bare.cost.RoundTripsPerEvent(), Baseline: base},
			{Metric: "round trips per event, consumer.New runner (defaults)", Ours: runner.cost.RoundTripsPerEvent(), Base: batched.cost.RoundTripsPerEvent(), Baseline: baseBatched},
			{Metric: "cold start: Run → first event committed, ms, consumer.New runner", Ours: runner.coldMillis(), Base: bare.coldMillis(), Baseline: base},
		},
		Notes: []string{
			fmt.Sprintf("%d events over %d aggregates × %d consecutive versions, %d partitions keyed by aggregate, prefilled; each variant reads the whole topic from the start in its own consumer group and schema, on a pool of %d connections all open before it starts, %d round(s), the order reversed every other round; the rate runs from the %dth event committed (the first %d%% are the warm-up) to the last; the cold start from Run to the first event committed (group join included)",
				n, aggregates, consumerVersions, Partitions, Partitions+4, e.sizes.ConsumerRounds, warmEvents(n), 100/warmShare),
			fmt.Sprintf("in flight: watermill-kafka + Router handles one message per partition at a time (%d); the runner and the two laned bare handlers up to %d lanes per partition (%d), the runner's and the batching one's each with a batch; all bounded by the pool's %d connections",
				Partitions, consumer.DefaultLanes, consumer.DefaultLanes*Partitions, Partitions+4),
			"the laned bare handlers commit an offset only when every record below it is done (the runner's rule: the lowest unfinished offset per partition); they read records with Sarama directly, so they also skip the Router and Watermill's per-message hand-off that the runner pays",
			"costs (cost table): each variant's pool over the whole drain, warm-up and start-up included; rows and WAL of the variant's schema",
		},
	}
	if n < FullSizes().ConsumerBacklog {
		res.Notes = append(res.Notes, fmt.Sprintf("reduced backlog (%d instead of %d)", n, FullSizes().ConsumerBacklog))
	}
	for _, v := range variants {
		res.Costs = append(res.Costs, v.sum.cost)
	}
	res.Ratios = []Ratio{
		{Name: "consumer_drain_throughput", Value: res.Rows[0].Ratio()},
		{Name: "consumer_drain_throughput_runner_single", Value: res.Rows[1].Ratio()},
		{Name: "consumer_drain_throughput_runner", Value: res.Rows[2].Ratio()},
		{Name: "consumer_drain_throughput_runner_vs_bare_batched", Value: res.Rows[3].Ratio()},
		{Name: "consumer_drain_throughput_runner_vs_bare_laned", Value: res.Rows[4].Ratio()},
		{Name: "consumer_drain_round_trips_per_event", Value: res.Rows[5].Ratio()},
		{Name: "consumer_drain_round_trips_per_event_vs_bare_batched", Value: res.Rows[6].Ratio()},
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

// consumerPool opens the consumer's pool, every connection connected: one
// per partition and a few spare. q may be nil.
func (e *env) consumerPool(ctx context.Context, q *queryCounter) (*pgxpool.Pool, error) {
	return e.warmPool(ctx, Partitions+4, q)
}

// progressCounter counts messages whose handling succeeded (outermost, so
// after the commit).
type progressCounter struct {
	done atomic.Int64
}

func (c *progressCounter) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil {
			c.done.Add(1)
		}
		return out, err
	}
}

// drainConsumer starts a consumer and times the counter: the cold start
// (start → first event committed), then the rate from the warm-up's last
// event to the last.
func (e *env) drainConsumer(ctx context.Context, label, profile string, n int, c *progressCounter, start func() error) (drainResult, error) {
	return e.measureDrain(ctx, label, profile, n, start, c.done.Load)
}

// stopCost ends d's cost window after the consumer stopped.
func (e *env) stopCost(ctx context.Context, m *meter, n int, d *drainResult) error {
	cost, err := m.stop(ctx, int64(n), d.rate())
	if err != nil {
		return err
	}
	d.cost = cost
	e.logCost(cost)
	return nil
}

// routerConsumer runs a watermill-kafka subscriber and a Router with one
// handler behind mw.
func (e *env) routerConsumer(ctx context.Context, k *kafkaEnv, topic, group string, mw []message.HandlerMiddleware, h message.NoPublishHandlerFunc) (stop func() error, err error) {
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               k.brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: consumerConfig("bench-" + group),
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
	effects := qualify(schema, "effects")
	if err := e.exec(ctx, fmt.Sprintf(effectsDDL, effects)); err != nil {
		drop()
		return "", business{}, nil, err
	}
	return schema, business{insert: fmt.Sprintf(insertEffectSQL, effects)}, drop, nil
}

// checkEffects verifies every event was applied exactly once.
func (e *env) checkEffects(ctx context.Context, schema string, n int) error {
	var got, distinct int
	err := e.admin.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM `+qualify(schema, "effects")).Scan(&got, &distinct)
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
		label: "bare handler (Router)", profile: "consumer_drain.bare",
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
			el, err := middleware.New(pool, middleware.Config{Group: group, Schema: schema, Logger: quiet})
			if err != nil {
				return nil, nil, err
			}
			return el.MiddlewareFor("bench"), func(msg *message.Message) error {
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
	q := newQueryCounter()
	pool, err := e.consumerPool(ctx, q)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	mw, handler, err := v.build(pool, schema, biz)
	if err != nil {
		return drainResult{}, err
	}
	m, err := e.startMeter(ctx, "consumer", v.label, []string{schema}, []*pgxpool.Pool{pool}, q)
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
	if err == nil {
		err = e.stopCost(ctx, m, n, &d)
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
	q := newQueryCounter()
	pool, err := e.warmPool(ctx, conns, q)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	var c progressCounter
	cons, err := consumer.New(pool, consumer.Config{
		Config: middleware.Config{
			Group:      v.group,
			Schema:     schema,
			Middleware: []message.HandlerMiddleware{c.middleware},
			Logger:     quiet,
		},
		Brokers:   k.brokers,
		Topics:    []string{topic},
		Lanes:     v.lanes,
		BatchSize: v.batch,
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
	m, err := e.startMeter(ctx, "consumer", v.label, []string{schema}, []*pgxpool.Pool{pool}, q)
	if err != nil {
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
	if err == nil {
		err = e.stopCost(ctx, m, n, &d)
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
	err := e.admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+qualify(schema, "parked_events")+`),
		(SELECT count(*) FROM `+qualify(schema, "processed_events")+`)`).Scan(&parked, &processed)
	if err != nil {
		return err
	}
	if parked != 0 || processed != n {
		return fmt.Errorf("gate state: %d parked, %d processed, want 0 and %d", parked, processed, n)
	}
	return nil
}
