package bench

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
)

// idleSettle is how long the components run before counting starts, so
// start-up statements (migrations checks, offsets rows, group joins) are
// not counted.
const idleSettle = 3 * time.Second

// runIdleQueries counts the statements an idle eventline relay and an
// idle eventline consumer send to PostgreSQL, and those of an idle plain
// watermill-sql forwarder, each through its own pool with a QueryTracer.
func runIdleQueries(ctx context.Context, e *env) (Result, error) {
	k, err := e.kafka()
	if err != nil {
		return Result{}, err
	}
	defer k.close()
	var closers []func() error
	defer func() {
		for i := len(closers) - 1; i >= 0; i-- {
			_ = closers[i]()
		}
	}()
	track := func(c func() error) { closers = append(closers, c) }

	// eventline relay and consumer on one migrated schema.
	schema, drop, err := e.newEventlineSchema(ctx, "idle_el", relayShards)
	if err != nil {
		return Result{}, err
	}
	track(func() error { drop(); return nil })
	topic, err := k.topic("idle")
	if err != nil {
		return Result{}, err
	}
	relayQ := newQueryCounter()
	relayPool, err := e.openPool(ctx, relayShards+4, relayQ)
	if err != nil {
		return Result{}, err
	}
	track(func() error { relayPool.Close(); return nil })
	relay, err := producer.NewRelay(ctx, relayPool, producer.RelayConfig{Schema: schema, Brokers: k.brokers, ID: "bench", Logger: quiet})
	if err != nil {
		return Result{}, err
	}
	track(goRun(ctx, relay.Run))

	consQ := newQueryCounter()
	consPool, err := e.openPool(ctx, Partitions+4, consQ)
	if err != nil {
		return Result{}, err
	}
	track(func() error { consPool.Close(); return nil })
	cons, err := consumer.New(consPool, consumer.Config{Config: middleware.Config{Group: "bench-idle", Schema: schema, Logger: quiet}, Brokers: k.brokers, Topics: []string{topic}})
	if err != nil {
		return Result{}, err
	}
	if err := cons.Handle("order.created", func(context.Context, pgx.Tx, eventline.Event) error { return nil }); err != nil {
		return Result{}, err
	}
	track(goRun(ctx, cons.Run))

	// plain watermill-sql forwarders: default poll interval, and tuned.
	plainQ, tunedQ := newQueryCounter(), newQueryCounter()
	for _, v := range []struct {
		q    *queryCounter
		poll time.Duration
	}{{plainQ, 0}, {tunedQ, tunedPollInterval}} {
		o, drop, err := e.newPlainOutbox(ctx, "idle_plain")
		if err != nil {
			return Result{}, err
		}
		track(func() error { drop(); return nil })
		pool, err := e.openPool(ctx, 4, v.q)
		if err != nil {
			return Result{}, err
		}
		track(func() error { pool.Close(); return nil })
		r, err := o.startPlainRelay(ctx, pool, k.brokers, v.poll)
		if err != nil {
			return Result{}, err
		}
		track(func() error { r.close(); return nil })
	}

	e.progressf("   settling for %s, then counting for %s", idleSettle, e.sizes.IdleWindow)
	time.Sleep(idleSettle)
	counters := []*queryCounter{relayQ, consQ, plainQ, tunedQ}
	type snap struct {
		q, rt, p int64
		kind     map[string]int64
	}
	before := make([]snap, len(counters))
	for i, c := range counters {
		before[i].q, before[i].rt, before[i].p, before[i].kind = c.snapshot()
	}
	t0 := time.Now()
	stopProfile := e.profile("idle_queries")
	select {
	case <-ctx.Done():
		stopProfile()
		return Result{}, ctx.Err()
	case <-time.After(e.sizes.IdleWindow):
	}
	stopProfile()
	window := time.Since(t0).Seconds()
	rates := make([]float64, len(counters))
	trips := make([]float64, len(counters))
	pings := make([]float64, len(counters))
	kinds := make([]string, len(counters))
	for i, c := range counters {
		q, rt, p, kind := c.snapshot()
		rates[i] = float64(q-before[i].q) / window
		trips[i] = float64(rt-before[i].rt) / window
		pings[i] = float64(p-before[i].p) / window
		kinds[i] = kindBreakdown(kind, before[i].kind, window)
	}
	names := []string{"eventline relay (8 shards)", "eventline consumer", "plain forwarder (poll 1s)", "plain forwarder (poll 10ms)"}
	for i, n := range names {
		e.progressf("   %-28s %6.2f statements/s in %.2f round trips/s + %.2f pings/s  [%s]", n, rates[i], trips[i], pings[i], kinds[i])
	}

	base := "idle plain watermill-sql forwarder, default poll (1s)"
	tunedBase := "idle plain forwarder, PollInterval 10ms"
	res := Result{
		Rows: []Row{
			{Metric: "idle relay queries/s, 8 shards", Ours: rates[0], Base: rates[2], Baseline: base, Target: "ours ≤ 20/s"},
			{Metric: "idle relay + consumer queries/s", Ours: rates[0] + rates[1], Base: rates[2], Baseline: base},
			{Metric: "idle relay queries/s, 8 shards", Ours: rates[0], Base: rates[3], Baseline: tunedBase},
		},
		Notes: []string{
			fmt.Sprintf("statements counted client-side by a pgx QueryTracer on each component's own pool over %s after %s of settling (BEGIN and COMMIT count; each statement of a pgx batch counts, the batch being one round trip); pgxpool's liveness pings are not statements and are listed apart", e.sizes.IdleWindow, idleSettle),
			fmt.Sprintf("eventline relay: %.2f/s in %.2f round trips/s [%s] + %.2f pings/s; eventline consumer: %.2f/s in %.2f round trips/s [%s] + %.2f pings/s; plain forwarder 1s: %.2f/s [%s]; 10ms: %.1f/s",
				rates[0], trips[0], kinds[0], pings[0], rates[1], trips[1], kinds[1], pings[1], rates[2], kinds[2], rates[3]),
			"a bare watermill-kafka consumer sends no statements when idle; the eventline consumer's come from its parked-event sweeper (every 5s)",
		},
	}
	res.Ratios = []Ratio{
		{Name: "idle_queries_per_second", Value: res.Rows[0].Ratio()},
		{Name: "idle_queries_per_second_with_consumer", Value: res.Rows[1].Ratio()},
		{Name: "idle_queries_per_second_vs_poll_10ms", Value: res.Rows[2].Ratio()},
	}
	return res, nil
}

// kindBreakdown formats per-statement-kind rates, largest first.
func kindBreakdown(after, before map[string]int64, window float64) string {
	type kv struct {
		k string
		v float64
	}
	var out []kv
	for k, v := range after {
		if d := v - before[k]; d > 0 {
			out = append(out, kv{k, float64(d) / window})
		}
	}
	slices.SortFunc(out, func(a, b kv) int {
		if a.v != b.v {
			if a.v > b.v {
				return -1
			}
			return 1
		}
		return strings.Compare(a.k, b.k)
	})
	parts := make([]string, len(out))
	for i, x := range out {
		parts[i] = fmt.Sprintf("%s %.2f", x.k, x.v)
	}
	return strings.Join(parts, ", ")
}
