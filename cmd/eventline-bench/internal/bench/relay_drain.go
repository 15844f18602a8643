package bench

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
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

// warmShare: the first 1/warmShare of a backlog (at least one event) is a
// drain's warm-up; its rate is measured over the rest.
const warmShare = 10

func warmEvents(n int) int { return max(n/warmShare, 1) }

// drainResult is one or more drains of a backlog by one variant.
type drainResult struct {
	// events and elapsed are the steady part: from the warm-up's last
	// event to the backlog's last.
	events  int
	elapsed time.Duration
	// cold is the time from starting the component to its first event
	// done (connections, leases, Kafka metadata or group join, first
	// statements prepared), summed over runs.
	cold time.Duration
	runs int
	// cost is over the whole drain, its warm-up included.
	cost Cost
}

func (d drainResult) rate() float64 { return float64(d.events) / d.elapsed.Seconds() }

// coldMillis is the mean cold start in milliseconds.
func (d drainResult) coldMillis() float64 { return millis(d.cold) / float64(max(d.runs, 1)) }

// add sums two measurements of the same variant.
func (d drainResult) add(o drainResult) drainResult {
	return drainResult{events: d.events + o.events, elapsed: d.elapsed + o.elapsed, cold: d.cold + o.cold, runs: d.runs + o.runs, cost: d.cost.add(o.cost)}
}

func drainTimeout(n int) time.Duration { return time.Minute + time.Duration(n/200)*time.Second }

// relayVariant is one relay_drain design.
type relayVariant struct {
	name  string
	drain func(ctx context.Context, k *kafkaEnv, events []eventline.Event) (drainResult, error)
	sum   drainResult
}

// runRelayDrain drains the same backlog with plain Watermill's forwarder,
// eventline's relay on 1 and on relayShards shards, and the hand-written
// relay, each from its own schema into its own topic, RelayRounds times,
// the order reversed every other round.
func runRelayDrain(ctx context.Context, e *env) (Result, error) {
	n := e.sizes.RelayBacklog
	k, err := e.kafka()
	if err != nil {
		return Result{}, err
	}
	defer k.close()
	events := backlog(n)

	plainName := "plain Watermill forwarder (1 topic, sync kafka.Publisher)"
	handName := fmt.Sprintf("hand-written SKIP LOCKED relay, %d workers × %d (no per-aggregate order)", handWorkers, handBatch)
	variants := []*relayVariant{
		{name: plainName, drain: e.drainPlain},
		{name: "eventline relay, 1 shard", drain: func(ctx context.Context, k *kafkaEnv, ev []eventline.Event) (drainResult, error) {
			return e.drainEventline(ctx, k, ev, 1)
		}},
		{name: fmt.Sprintf("eventline relay, %d shards", relayShards), drain: func(ctx context.Context, k *kafkaEnv, ev []eventline.Event) (drainResult, error) {
			return e.drainEventline(ctx, k, ev, relayShards)
		}},
		{name: handName, drain: e.drainHand},
	}
	rounds := max(e.sizes.RelayRounds, 1)
	for round := 0; round < rounds; round++ {
		if rounds > 1 {
			e.progressf("   round %d/%d", round+1, rounds)
		}
		for _, v := range alternate(variants, round) {
			d, err := v.drain(ctx, k, events)
			if err != nil {
				return Result{}, fmt.Errorf("%s: %w", v.name, err)
			}
			v.sum = v.sum.add(d)
		}
	}
	plain, one, sharded, hand := variants[0].sum, variants[1].sum, variants[2].sum, variants[3].sum

	res := Result{
		Rows: []Row{
			{Metric: fmt.Sprintf("drain events/s, %d shards", relayShards), Ours: sharded.rate(), Base: plain.rate(), Baseline: plainName, Target: "≥ 3.00"},
			{Metric: fmt.Sprintf("drain events/s, %d shards", relayShards), Ours: sharded.rate(), Base: hand.rate(), Baseline: handName, Target: "≥ 1.00"},
			{Metric: "drain events/s, 1 shard", Ours: one.rate(), Base: plain.rate(), Baseline: plainName},
			{Metric: "drain events/s, 1 shard", Ours: one.rate(), Base: hand.rate(), Baseline: handName},
			{Metric: fmt.Sprintf("round trips per event, %d shards", relayShards), Ours: sharded.cost.RoundTripsPerEvent(), Base: plain.cost.RoundTripsPerEvent(), Baseline: plainName},
			{Metric: fmt.Sprintf("cold start: relay started → first event relayed, ms, %d shards", relayShards), Ours: sharded.coldMillis(), Base: plain.coldMillis(), Baseline: plainName},
		},
		Notes: []string{
			fmt.Sprintf("backlog of %d events over %d aggregates (consecutive versions), prefilled before the relay starts on a pool whose connections are all open; the rate runs from the %dth event acknowledged (the first %d%% are the warm-up: statements prepared, shards under way) to the last, each acknowledged in the outbox after Kafka acknowledged it; %d round(s), the order reversed every other round; %d-partition topics, records keyed by aggregate id",
				n, max(n/10, 1), warmEvents(n), 100/warmShare, rounds, Partitions),
			fmt.Sprintf("eventline relay: defaults (batch %d, Sarama async idempotent producer, acks=all, 1 request in flight); plain Watermill: watermill-sql defaults (batch 100, REPEATABLE READ, offsets row FOR UPDATE) and Watermill's default Sarama sync config",
				producer.DefaultBatchSize),
			"cold start: from starting the relay (pool already open) to its first event acknowledged; the plain forwarder's includes up to one 1s poll interval",
			"costs (cost table): the relay's own pool over the whole drain, warm-up included; rows and WAL of the variant's schema",
		},
	}
	if e.sizes.RelayBacklog < FullSizes().RelayBacklog {
		res.Notes = append(res.Notes, fmt.Sprintf("reduced backlog (%d instead of %d): startup weighs more, ratios are indicative", n, FullSizes().RelayBacklog))
	}
	for _, v := range variants {
		res.Costs = append(res.Costs, v.sum.cost)
	}
	res.Ratios = []Ratio{
		{Name: "relay_drain_throughput", Value: res.Rows[0].Ratio()},
		{Name: "relay_drain_throughput_vs_handwritten", Value: res.Rows[1].Ratio()},
		{Name: "relay_drain_throughput_1shard", Value: res.Rows[2].Ratio()},
		{Name: "relay_drain_round_trips_per_event", Value: res.Rows[4].Ratio()},
	}
	return res, nil
}

// alternate returns vs in order on even rounds and reversed on odd ones,
// so drift in the machine's load does not always favour the same design.
func alternate[T any](vs []T, round int) []T {
	out := slices.Clone(vs)
	if round%2 == 1 {
		slices.Reverse(out)
	}
	return out
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

// measureDrain starts a component on a backlog of n and times it: the
// cold start (start → first event), then the rate from the warm-up's last
// event (warmEvents) to the last.
func (e *env) measureDrain(ctx context.Context, label, profile string, n int, start func() error, count func() int64) (drainResult, error) {
	stopProfile := e.profile(profile)
	t0 := time.Now()
	if err := start(); err != nil {
		stopProfile()
		return drainResult{}, err
	}
	stopWatch := e.watch(label, n, count)
	marks, err := waitMarks(ctx, drainTimeout(n), count, 1, int64(warmEvents(n)), int64(n))
	stopWatch()
	stopProfile()
	if err != nil {
		return drainResult{}, err
	}
	d := drainResult{events: n - warmEvents(n), elapsed: marks[2].Sub(marks[1]), cold: marks[0].Sub(t0), runs: 1}
	if d.events == 0 { // a backlog of one: nothing left after the warm-up
		d.events, d.elapsed = n, marks[2].Sub(marks[0])
	}
	e.progressf("   %s: %d events in %s, cold start %s, then %.0f events/s", label, n, marks[2].Sub(t0).Round(time.Millisecond), d.cold.Round(time.Millisecond), d.rate())
	return d, nil
}

// waitMarks polls count until it reaches each of marks (ascending) and
// returns when it did.
func waitMarks(ctx context.Context, timeout time.Duration, count func() int64, marks ...int64) ([]time.Time, error) {
	out := make([]time.Time, 0, len(marks))
	deadline := time.Now().Add(timeout)
	for len(out) < len(marks) {
		now := time.Now()
		c := count()
		for len(out) < len(marks) && c >= marks[len(out)] {
			out = append(out, now)
		}
		if len(out) == len(marks) {
			break
		}
		if now.After(deadline) {
			return nil, fmt.Errorf("%w: %d of %d after %s", errIncomplete, c, marks[len(marks)-1], timeout)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
	return out, nil
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
	q := newQueryCounter()
	pool, err := e.warmPool(ctx, 4, q)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	m, err := e.startMeter(ctx, "relay", "plain Watermill forwarder", []string{o.schema}, []*pgxpool.Pool{pool}, q)
	if err != nil {
		return drainResult{}, err
	}
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
	if d.cost, err = m.stop(ctx, int64(len(events)), d.rate()); err != nil {
		return d, err
	}
	e.logCost(d.cost)
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
	q := newQueryCounter()
	pool, err := e.warmPool(ctx, int32(shards)+4, q)
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
	m, err := e.startMeter(ctx, "relay", label, []string{schema}, []*pgxpool.Pool{pool}, q)
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
	if d.cost, err = m.stop(ctx, int64(len(events)), d.rate()); err != nil {
		return d, err
	}
	e.logCost(d.cost)
	st, err := admin.ReadOutboxStatus(ctx, e.admin, schema)
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
	q := newQueryCounter()
	pool, err := e.warmPool(ctx, 2*handWorkers+1, q)
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	m, err := e.startMeter(ctx, "relay", "hand-written relay", []string{o.schema}, []*pgxpool.Pool{pool}, q)
	if err != nil {
		return drainResult{}, err
	}
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
	if d.cost, err = m.stop(ctx, int64(len(events)), d.rate()); err != nil {
		return d, err
	}
	e.logCost(d.cost)
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
