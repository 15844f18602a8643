package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/producer"
)

// relayShards is the shard count of the sharded eventline relay variant.
const relayShards = 8

// prefillBatch is the number of events per prefill transaction.
const prefillBatch = 500

// backlog returns n events of type order.created over n/10 aggregates,
// round robin, so every aggregate gets consecutive versions. Versions are
// set for the baselines; eventline's producer assigns the same ones itself.
func backlog(n int) []eventline.Event {
	aggregates := max(n/10, 1)
	versions := make([]int64, aggregates)
	out := make([]eventline.Event, n)
	now := time.Now()
	for i := range out {
		a := i % aggregates
		versions[a]++
		ev := orderCreated(fmt.Sprintf("order-%d", a), i)
		ev.AggregateVersion = versions[a]
		out[i] = ev.WithDefaults(now)
	}
	return out
}

// encode turns events into Watermill messages with eventline's envelope,
// so every design carries the same payload and metadata.
func encode(events []eventline.Event) ([]*message.Message, error) {
	out := make([]*message.Message, len(events))
	for i, e := range events {
		m, err := eventline.Encode(e)
		if err != nil {
			return nil, err
		}
		out[i] = m
	}
	return out, nil
}

type drainResult struct {
	events  int
	elapsed time.Duration
}

func (d drainResult) rate() float64 { return float64(d.events) / d.elapsed.Seconds() }

// add sums two measurements of the same variant.
func (d drainResult) add(o drainResult) drainResult {
	return drainResult{events: d.events + o.events, elapsed: d.elapsed + o.elapsed}
}

func drainTimeout(n int) time.Duration { return time.Minute + time.Duration(n/200)*time.Second }

// runRelayDrain drains the same backlog with plain Watermill's forwarder,
// eventline's relay on 1 and on relayShards shards, and the hand-written
// relay, each from its own schema into its own topic.
func runRelayDrain(ctx context.Context, e *env) (Result, error) {
	n := e.sizes.RelayBacklog
	k, err := e.kafka()
	if err != nil {
		return Result{}, err
	}
	defer k.close()
	events := backlog(n)

	plain, err := e.drainPlain(ctx, k, events)
	if err != nil {
		return Result{}, fmt.Errorf("plain Watermill: %w", err)
	}
	one, err := e.drainEventline(ctx, k, events, 1)
	if err != nil {
		return Result{}, fmt.Errorf("eventline, 1 shard: %w", err)
	}
	sharded, err := e.drainEventline(ctx, k, events, relayShards)
	if err != nil {
		return Result{}, fmt.Errorf("eventline, %d shards: %w", relayShards, err)
	}
	hand, err := e.drainHand(ctx, k, events)
	if err != nil {
		return Result{}, fmt.Errorf("hand-written relay: %w", err)
	}

	plainName := "plain Watermill forwarder (1 topic, sync kafka.Publisher)"
	handName := fmt.Sprintf("hand-written SKIP LOCKED relay, %d workers × %d (no per-aggregate order)", handWorkers, handBatch)
	res := Result{
		Rows: []Row{
			{Metric: fmt.Sprintf("drain events/s, %d shards", relayShards), Ours: sharded.rate(), Base: plain.rate(), Baseline: plainName, Target: "≥ 3.00"},
			{Metric: fmt.Sprintf("drain events/s, %d shards", relayShards), Ours: sharded.rate(), Base: hand.rate(), Baseline: handName, Target: "≥ 1.00"},
			{Metric: "drain events/s, 1 shard", Ours: one.rate(), Base: plain.rate(), Baseline: plainName},
			{Metric: "drain events/s, 1 shard", Ours: one.rate(), Base: hand.rate(), Baseline: handName},
		},
		Notes: []string{
			fmt.Sprintf("backlog of %d events over %d aggregates (consecutive versions), prefilled before the clock starts; the clock runs from starting the relay until every event is acknowledged in the outbox after Kafka acknowledged it; %d-partition topics, records keyed by aggregate id",
				n, max(n/10, 1), Partitions),
			fmt.Sprintf("eventline relay: defaults (batch %d, Sarama async idempotent producer, acks=all, 1 request in flight); plain Watermill: watermill-sql defaults (batch 100, REPEATABLE READ, offsets row FOR UPDATE) and Watermill's default Sarama sync config",
				producer.DefaultBatchSize),
		},
	}
	if e.sizes.RelayBacklog < FullSizes().RelayBacklog {
		res.Notes = append(res.Notes, fmt.Sprintf("reduced backlog (%d instead of %d): startup weighs more, ratios are indicative", n, FullSizes().RelayBacklog))
	}
	res.Ratios = []Ratio{
		{Name: "relay_drain_throughput", Value: res.Rows[0].Ratio()},
		{Name: "relay_drain_throughput_vs_handwritten", Value: res.Rows[1].Ratio()},
		{Name: "relay_drain_throughput_1shard", Value: res.Rows[2].Ratio()},
	}
	return res, nil
}

// prefill writes batches through write, each in its own transaction.
func (e *env) prefill(ctx context.Context, label string, n int, write func(tx pgx.Tx, from, to int) error) error {
	start := time.Now()
	for from := 0; from < n; from += prefillBatch {
		to := min(from+prefillBatch, n)
		if err := pgx.BeginFunc(ctx, e.admin, func(tx pgx.Tx) error { return write(tx, from, to) }); err != nil {
			return fmt.Errorf("prefill: %w", err)
		}
	}
	e.progressf("   %s: prefilled %d events in %s", label, n, time.Since(start).Round(time.Millisecond))
	return nil
}

// measureDrain times count reaching n, with progress and profiling.
func (e *env) measureDrain(ctx context.Context, label, profile string, n int, start func() error, count func() int64) (drainResult, error) {
	stopProfile := e.profile(profile)
	t0 := time.Now()
	if err := start(); err != nil {
		stopProfile()
		return drainResult{}, err
	}
	stopWatch := e.watch(label, n, count)
	end, err := waitFor(ctx, drainTimeout(n), int64(n), count)
	stopWatch()
	stopProfile()
	if err != nil {
		return drainResult{}, err
	}
	d := drainResult{events: n, elapsed: end.Sub(t0)}
	e.progressf("   %s: %d events in %s = %.0f events/s", label, n, d.elapsed.Round(time.Millisecond), d.rate())
	return d, nil
}

// checkRecords verifies Kafka holds exactly n records in topic.
func checkRecords(k *kafkaEnv, topic string, n int) error {
	got, err := k.records(topic)
	if err != nil {
		return err
	}
	if got != int64(n) {
		return fmt.Errorf("topic %s holds %d records, want %d", topic, got, n)
	}
	return nil
}

func (e *env) drainPlain(ctx context.Context, k *kafkaEnv, events []eventline.Event) (drainResult, error) {
	const label = "plain Watermill"
	o, drop, err := e.newPlainOutbox(ctx, "relay_plain")
	if err != nil {
		return drainResult{}, err
	}
	defer drop()
	topic, err := k.topic("relay-plain")
	if err != nil {
		return drainResult{}, err
	}
	msgs, err := encode(events)
	if err != nil {
		return drainResult{}, err
	}
	if err := e.prefill(ctx, label, len(msgs), func(tx pgx.Tx, from, to int) error {
		return o.publish(tx, topic, msgs[from:to]...)
	}); err != nil {
		return drainResult{}, err
	}
	pool, err := e.openPool(ctx, 4, nil)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	var r *plainRelay
	defer func() {
		if r != nil {
			r.close()
		}
	}()
	d, err := e.measureDrain(ctx, label, "relay_drain.plain", len(events), func() error {
		r, err = o.startPlainRelay(ctx, pool, k.brokers, 0)
		return err
	}, func() int64 {
		if r == nil {
			return 0
		}
		return r.forwarded.Load()
	})
	if err != nil {
		return d, err
	}
	r.close()
	return d, checkRecords(k, topic, len(events))
}

func (e *env) drainEventline(ctx context.Context, k *kafkaEnv, events []eventline.Event, shards int) (drainResult, error) {
	label := fmt.Sprintf("eventline relay, %d shard(s)", shards)
	schema, drop, err := e.newEventlineSchema(ctx, fmt.Sprintf("relay_el%d", shards), shards)
	if err != nil {
		return drainResult{}, err
	}
	defer drop()
	topic, err := k.topic(fmt.Sprintf("relay-el%d", shards))
	if err != nil {
		return drainResult{}, err
	}
	prod, err := producer.New(ctx, e.admin, producer.Config{Schema: schema, DefaultTopic: topic, Logger: quiet})
	if err != nil {
		return drainResult{}, err
	}
	// Versions are left to the producer, which assigns the same ones.
	unversioned := make([]eventline.Event, len(events))
	for i, ev := range events {
		ev.AggregateVersion = 0
		unversioned[i] = ev
	}
	if err := e.prefill(ctx, label, len(events), func(tx pgx.Tx, from, to int) error {
		return prod.PublishTx(ctx, tx, unversioned[from:to]...)
	}); err != nil {
		return drainResult{}, err
	}
	pool, err := e.openPool(ctx, int32(shards)+4, nil)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	reg := prometheus.NewRegistry()
	metrics, err := producer.NewRelayMetrics(reg)
	if err != nil {
		return drainResult{}, err
	}
	relay, err := producer.NewRelay(ctx, pool, producer.RelayConfig{
		Schema: schema, Brokers: k.brokers, ID: "bench", Logger: quiet, Metrics: metrics,
	})
	if err != nil {
		return drainResult{}, err
	}
	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { stop(); wg.Wait() }()
	var runErr error
	d, err := e.measureDrain(ctx, label, fmt.Sprintf("relay_drain.eventline_%dshards", shards), len(events), func() error {
		wg.Add(1)
		go func() { defer wg.Done(); runErr = relay.Run(rctx) }()
		return nil
	}, func() int64 { return int64(counterSum(reg, "eventline_relay_forwarded_total")) })
	stop()
	wg.Wait()
	if err == nil {
		err = runErr
	}
	if err != nil {
		return d, err
	}
	st, err := producer.ReadStatus(ctx, e.admin, schema)
	if err != nil {
		return d, err
	}
	if st.Backlog() != 0 {
		return d, fmt.Errorf("outbox backlog is %d after the drain", st.Backlog())
	}
	return d, checkRecords(k, topic, len(events))
}

func (e *env) drainHand(ctx context.Context, k *kafkaEnv, events []eventline.Event) (drainResult, error) {
	const label = "hand-written relay"
	o, drop, err := e.newHandOutbox(ctx)
	if err != nil {
		return drainResult{}, err
	}
	defer drop()
	topic, err := k.topic("relay-hand")
	if err != nil {
		return drainResult{}, err
	}
	if err := e.prefill(ctx, label, len(events), func(tx pgx.Tx, from, to int) error {
		return o.insert(ctx, tx, topic, events[from:to])
	}); err != nil {
		return drainResult{}, err
	}
	pool, err := e.openPool(ctx, 2*handWorkers+1, nil)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	var r *handRelay
	d, err := e.measureDrain(ctx, label, "relay_drain.handwritten", len(events), func() error {
		r, err = o.startRelay(ctx, pool, k.brokers)
		return err
	}, func() int64 {
		if r == nil {
			return 0
		}
		return r.sent.Load()
	})
	if r != nil {
		if cerr := r.close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		return d, err
	}
	return d, checkRecords(k, topic, len(events))
}

// counterSum sums every series of a counter family in reg.
func counterSum(reg prometheus.Gatherer, name string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}
