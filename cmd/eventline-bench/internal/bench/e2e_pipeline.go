package bench

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
)

// e2eWorkers is the size of the producers' pool: the load generator hands
// each scheduled event to an idle worker.
func (e *env) e2eWorkers() int { return 2 * e.sizes.Producers }

// tracker pairs each event's producer commit with its consumer commit.
type tracker struct {
	mu        sync.Mutex
	committed map[string]time.Time
	applied   map[string]time.Time
	// inKafka is the Kafka record timestamp (set by the producing client
	// when it batches the record; millisecond precision), which splits
	// the latency into the relay hop and the consumer hop.
	inKafka map[string]time.Time
}

func newTracker() *tracker {
	return &tracker{committed: map[string]time.Time{}, applied: map[string]time.Time{}, inKafka: map[string]time.Time{}}
}

func (t *tracker) commit(id string, at time.Time) {
	t.mu.Lock()
	t.committed[id] = at
	t.mu.Unlock()
}

// apply records that the consumer committed the event; inKafka is its
// Kafka record's timestamp, or zero when OnConsume records it.
func (t *tracker) apply(id string, at, inKafka time.Time) {
	t.mu.Lock()
	if _, dup := t.applied[id]; !dup {
		t.applied[id] = at
		if !inKafka.IsZero() {
			t.inKafka[id] = inKafka
		}
	}
	t.mu.Unlock()
}

var _ sarama.ConsumerInterceptor = (*tracker)(nil)

// OnConsume records an event's Kafka record timestamp when the eventline
// consumer's Sarama client reads the record (the consumer's handlers are
// not given Kafka metadata), the first time the event is read.
func (t *tracker) OnConsume(m *sarama.ConsumerMessage) {
	for _, h := range m.Headers {
		if h != nil && string(h.Key) == eventline.MetaEventID {
			t.mu.Lock()
			if _, seen := t.inKafka[string(h.Value)]; !seen {
				t.inKafka[string(h.Value)] = m.Timestamp
			}
			t.mu.Unlock()
			return
		}
	}
}

// appliedOf counts the ids applied so far.
func (t *tracker) appliedOf(ids []string) int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	var n int64
	for _, id := range ids {
		if _, ok := t.applied[id]; ok {
			n++
		}
	}
	return n
}

// latencyOf returns commit → applied of each of ids (all applied).
func (t *tracker) latencyOf(ids []string) []time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]time.Duration, 0, len(ids))
	for _, id := range ids {
		out = append(out, t.applied[id].Sub(t.committed[id]))
	}
	return out
}

// pipeline is one design under load: publish runs a business transaction
// through db (the producers' pool or one of its connections) that emits
// one event and returns the event id once committed; the pipeline's
// consumer reports applied events to the tracker.
type pipeline struct {
	name     string
	publish  func(ctx context.Context, db txBeginner) (string, error)
	prodPool *pgxpool.Pool
	tr       *tracker
	close    func() error
	// schemas are the pipeline's own; stages its three pools, each with a
	// tracer.
	schemas []string
	stages  []pipelineStage
	// cold is measured by startPipeline.
	cold coldStart
}

// pipelineStage is one stage's pool and its tracer.
type pipelineStage struct {
	name string
	pool *pgxpool.Pool
	q    *queryCounter
}

// stagePool opens a stage's pool, every connection connected, with a
// tracer, and records it.
func (p *pipeline) stagePool(ctx context.Context, e *env, stage string, conns int32) (*pgxpool.Pool, error) {
	q := newQueryCounter()
	pool, err := e.warmPool(ctx, conns, q)
	if err != nil {
		return nil, err
	}
	p.stages = append(p.stages, pipelineStage{name: stage, pool: pool, q: q})
	return pool, nil
}

func (p *pipeline) pools() []*pgxpool.Pool {
	out := make([]*pgxpool.Pool, len(p.stages))
	for i, s := range p.stages {
		out[i] = s.pool
	}
	return out
}

func (p *pipeline) counters() []*queryCounter {
	out := make([]*queryCounter, len(p.stages))
	for i, s := range p.stages {
		out[i] = s.q
	}
	return out
}

func plainPipelineName(pollInterval time.Duration) string {
	if pollInterval == 0 {
		return "plain Watermill (poll 1s)"
	}
	return fmt.Sprintf("plain Watermill (poll %s)", pollInterval)
}

// eventlinePipeline starts PublishTx → Relay → Kafka → consumer.New.
func (e *env) eventlinePipeline(ctx context.Context, k *kafkaEnv) (*pipeline, error) {
	schema, drop, err := e.newEventlineSchema(ctx, "e2e_el", relayShards)
	if err != nil {
		return nil, err
	}
	p := &pipeline{name: "eventline", tr: newTracker(), schemas: []string{schema}}
	var closers []func() error
	p.close = func() error {
		var first error
		for i := len(closers) - 1; i >= 0; i-- {
			if err := closers[i](); err != nil && first == nil {
				first = err
			}
		}
		drop()
		return first
	}
	fail := func(err error) (*pipeline, error) { _ = p.close(); return nil, err }

	orders, effects := qualify(schema, "orders"), qualify(schema, "effects")
	if err := e.exec(ctx, fmt.Sprintf(ordersDDL, orders), fmt.Sprintf(effectsDDL, effects)); err != nil {
		return fail(err)
	}
	topic, err := k.topic("e2e-el")
	if err != nil {
		return fail(err)
	}
	prodPool, err := p.stagePool(ctx, e, "producer", int32(e.e2eWorkers())+2)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { prodPool.Close(); return nil })
	prod, err := producer.New(ctx, prodPool, producer.Config{Schema: schema, DefaultTopic: topic, Logger: quiet})
	if err != nil {
		return fail(err)
	}
	w := &orderWriter{pool: prodPool, insert: fmt.Sprintf(insertOrderSQL, orders)}
	publishTx := func(ctx context.Context, tx pgx.Tx, ev eventline.Event) error { return prod.PublishTx(ctx, tx, ev) }
	p.publish = func(ctx context.Context, db txBeginner) (string, error) {
		ev, err := w.tx(ctx, db, writeMode{publish: publishTx})
		if err != nil {
			return "", err
		}
		p.tr.commit(ev.ID, time.Now())
		return ev.ID, nil
	}
	p.prodPool = prodPool

	relayPool, err := p.stagePool(ctx, e, "relay", relayShards+4)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { relayPool.Close(); return nil })
	relay, err := producer.NewRelay(ctx, relayPool, producer.RelayConfig{Schema: schema, Brokers: k.brokers, ID: "bench", Logger: quiet})
	if err != nil {
		return fail(err)
	}
	closers = append(closers, goRun(ctx, relay.Run))

	consPool, err := p.stagePool(ctx, e, "consumer", Partitions+4)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { consPool.Close(); return nil })
	// The consumer's default Sarama configuration, with the tracker reading
	// each record's timestamp.
	sc := consumerConfig("eventline-bench-e2e-el")
	sc.Consumer.Interceptors = []sarama.ConsumerInterceptor{p.tr}
	cons, err := consumer.New(consPool, consumer.Config{Config: middleware.Config{Group: "bench-e2e-el", Schema: schema, Logger: quiet}, Brokers: k.brokers, Topics: []string{topic}, SaramaConfig: sc})
	if err != nil {
		return fail(err)
	}
	biz := business{insert: fmt.Sprintf(insertEffectSQL, effects)}
	err = cons.Handle("order.created", func(ctx context.Context, tx pgx.Tx, ev eventline.Event) error {
		if err := biz.apply(ctx, tx, ev); err != nil {
			return err
		}
		middleware.AfterCommit(ctx, func() { p.tr.apply(ev.ID, time.Now(), time.Time{}) })
		return nil
	})
	if err != nil {
		return fail(err)
	}
	closers = append(closers, goRun(ctx, cons.Run))
	return p, nil
}

// plainPipeline starts the plain Watermill pipeline: watermill-sql
// publisher via forwarder.NewPublisher in the business tx → forwarder →
// sync kafka.Publisher → watermill-kafka + Router with a bare handler.
func (e *env) plainPipeline(ctx context.Context, k *kafkaEnv, pollInterval time.Duration) (*pipeline, error) {
	o, drop, err := e.newPlainOutbox(ctx, "e2e_plain")
	if err != nil {
		return nil, err
	}
	p := &pipeline{name: plainPipelineName(pollInterval), tr: newTracker(), schemas: []string{o.schema}}
	var closers []func() error
	p.close = func() error {
		var first error
		for i := len(closers) - 1; i >= 0; i-- {
			if err := closers[i](); err != nil && first == nil {
				first = err
			}
		}
		drop()
		return first
	}
	fail := func(err error) (*pipeline, error) { _ = p.close(); return nil, err }

	orders, effects := qualify(o.schema, "orders"), qualify(o.schema, "effects")
	if err := e.exec(ctx, fmt.Sprintf(ordersDDL, orders), fmt.Sprintf(effectsDDL, effects)); err != nil {
		return fail(err)
	}
	topic, err := k.topic("e2e-plain")
	if err != nil {
		return fail(err)
	}
	prodPool, err := p.stagePool(ctx, e, "producer", int32(e.e2eWorkers())+2)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { prodPool.Close(); return nil })
	insertOrder := fmt.Sprintf(insertOrderSQL, orders)
	var seq atomic.Int64
	p.publish = func(ctx context.Context, db txBeginner) (string, error) {
		n := int(seq.Add(1))
		var id string
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			var orderID int64
			if err := tx.QueryRow(ctx, insertOrder, "customer-"+strconv.Itoa(n%997), 1000+n%5000).Scan(&orderID); err != nil {
				return err
			}
			ev := orderCreated(strconv.FormatInt(orderID, 10), n)
			ev.AggregateVersion = 1
			ev = ev.WithDefaults(time.Now())
			msg, err := eventline.Encode(ev)
			if err != nil {
				return err
			}
			id = ev.ID
			return o.publish(tx, topic, msg)
		})
		if err != nil {
			return "", err
		}
		p.tr.commit(id, time.Now())
		return id, nil
	}
	p.prodPool = prodPool

	relayPool, err := p.stagePool(ctx, e, "relay", 4)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { relayPool.Close(); return nil })
	relay, err := o.startPlainRelay(ctx, relayPool, k.brokers, pollInterval)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { relay.close(); return nil })

	consPool, err := p.stagePool(ctx, e, "consumer", Partitions+4)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { consPool.Close(); return nil })
	biz := business{insert: fmt.Sprintf(insertEffectSQL, effects)}
	// Each plain pipeline has a group of its own: two that run at once
	// in one group would rebalance each other.
	stop, err := e.routerConsumer(ctx, k, topic, "bench-e2e-plain-"+profileName(pollInterval.String()), nil, func(msg *message.Message) error {
		ev, err := eventline.Decode(msg)
		if err != nil {
			return err
		}
		if err := pgx.BeginFunc(msg.Context(), consPool, func(tx pgx.Tx) error { return biz.apply(msg.Context(), tx, ev) }); err != nil {
			return err
		}
		ts, _ := kafka.MessageTimestampFromCtx(msg.Context())
		p.tr.apply(ev.ID, time.Now(), ts)
		return nil
	})
	if err != nil {
		return fail(err)
	}
	closers = append(closers, stop)
	return p, nil
}
