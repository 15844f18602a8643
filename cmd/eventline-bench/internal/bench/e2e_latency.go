package bench

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	// e2eWarmup is offered at each rate before measuring.
	e2eWarmup = time.Second
	// tunedPollInterval is the plain forwarder's poll interval in the
	// informational "tuned" variant.
	tunedPollInterval = 10 * time.Millisecond
	// headlineRate is the rate of the headline ratio and of the tuned
	// variant (the middle rate when it is not among Sizes.Rates).
	headlineRate = 500
	// maxRateP99 is the p99 the rate search keeps under; maxRateCap caps
	// the search.
	maxRateP99 = 100 * time.Millisecond
	maxRateCap = 20_000
	// drainEvents is the backlog the drain measurement publishes (half in
	// the quick run).
	drainEvents = 10_000
)

// e2eDesign is one pipeline design of end_to_end_latency.
type e2eDesign struct {
	build func(context.Context, *kafkaEnv) (*pipeline, error)
	// cold collects the cold start samples of every start.
	coldLatency, coldTx latencies
}

// run starts a pipeline of the design, warms it, runs fn on it and
// closes it.
func (d *e2eDesign) run(ctx context.Context, e *env, k *kafkaEnv, fn func(*pipeline) error) error {
	p, err := e.startPipeline(ctx, k, d.build)
	if err != nil {
		return err
	}
	defer e.closePipeline(p)
	for _, l := range p.cold.latencies {
		d.coldLatency.add(l)
	}
	for _, l := range p.cold.txs {
		d.coldTx.add(l)
	}
	return fn(p)
}

// runEndToEndLatency offers fixed event rates to the eventline pipeline and
// to the plain Watermill pipeline and measures commit → consumer commit.
// The designs take turns rate by rate (which goes first alternates), each
// turn on a pipeline started for it and warmed before the rate is offered,
// so both see the same load and one pipeline's connections at a time; the
// tuned plain pipeline takes a turn at the headline rate.
func runEndToEndLatency(ctx context.Context, e *env) (Result, error) {
	loadStart := loadAvg()
	k, err := e.kafka()
	if err != nil {
		return Result{}, err
	}
	defer k.close()
	rates := e.sizes.Rates
	tunedRate := headlineRate
	if !slices.Contains(rates, tunedRate) {
		tunedRate = rates[len(rates)/2]
	}

	el := &e2eDesign{build: e.eventlinePipeline}
	pl := &e2eDesign{build: func(ctx context.Context, k *kafkaEnv) (*pipeline, error) { return e.plainPipeline(ctx, k, 0) }}
	tn := &e2eDesign{build: func(ctx context.Context, k *kafkaEnv) (*pipeline, error) {
		return e.plainPipeline(ctx, k, tunedPollInterval)
	}}
	ours, plain := map[int]rateResult{}, map[int]rateResult{}
	var tuned rateResult
	for i, rate := range rates {
		turns := alternate([]*e2eDesign{el, pl}, i)
		if rate == tunedRate {
			turns = append(turns, tn)
		}
		for _, d := range turns {
			err := d.run(ctx, e, k, func(p *pipeline) error {
				s, err := e.offer(ctx, p, p.name, rate)
				if err != nil {
					return fmt.Errorf("%s @ %d/s: %w", p.name, rate, err)
				}
				switch d {
				case el:
					ours[rate] = s
				case pl:
					plain[rate] = s
				default:
					tuned = s
				}
				return nil
			})
			if err != nil {
				return Result{}, err
			}
		}
	}

	var maxRate int
	var drainRate, plainDrain float64
	err = el.run(ctx, e, k, func(p *pipeline) error {
		var err error
		if !e.cfg.Quick && e.cfg.Sizes == nil {
			if maxRate, err = e.rateSearch(ctx, p, p.name, ours); err != nil {
				return err
			}
		}
		drainRate, err = e.drain(ctx, p, p.name)
		return err
	})
	if err != nil {
		return Result{}, fmt.Errorf("eventline pipeline: %w", err)
	}
	err = pl.run(ctx, e, k, func(p *pipeline) error {
		var err error
		plainDrain, err = e.drain(ctx, p, p.name)
		return err
	})
	if err != nil {
		return Result{}, fmt.Errorf("plain Watermill pipeline: %w", err)
	}

	base := "plain Watermill pipeline, default poll interval (1s)"
	tunedBase := fmt.Sprintf("plain Watermill, PollInterval %s (tuned)", tunedPollInterval)
	var res Result
	for _, r := range rates {
		o, p := ours[r], plain[r]
		var targets []string
		if r == tunedRate {
			targets = append(targets, "ours ≤ 100 ms")
		}
		if r == 500 || r == 1000 {
			targets = append(targets, "ours ≤ 20 ms "+issue10)
		}
		res.Rows = append(res.Rows,
			Row{Metric: fmt.Sprintf("p50 ms @ %d events/s", r), Ours: millis(o.p50), Base: millis(p.p50), Baseline: base},
			Row{Metric: fmt.Sprintf("p95 ms @ %d events/s", r), Ours: millis(o.p95), Base: millis(p.p95), Baseline: base},
			Row{Metric: fmt.Sprintf("p99 ms @ %d events/s", r), Ours: millis(o.p99), Base: millis(p.p99), Baseline: base, Target: strings.Join(targets, "; ")},
		)
		if o.cpuOK && p.cpuOK {
			res.Rows = append(res.Rows, Row{Metric: fmt.Sprintf("machine CPU busy %% @ %d events/s (%d cores; ours %.2f cores)", r, runtime.NumCPU(), o.cpu.cores),
				Ours: 100 * o.cpu.busy, Base: 100 * p.cpu.busy, Baseline: base + ", same measure"})
		}
		res.Ratios = append(res.Ratios, Ratio{Name: fmt.Sprintf("end_to_end_latency_p99_at_%d", r), Value: ratio(millis(o.p99), millis(p.p99))})
		for _, s := range []rateResult{o, p} {
			res.Costs = append(res.Costs, s.costs...)
		}
		if r == tunedRate {
			res.Costs = append(res.Costs, tuned.costs...)
		}
	}
	if o, ok := ours[tunedRate]; ok {
		t := tuned
		res.Rows = append(res.Rows,
			Row{Metric: fmt.Sprintf("p50 ms @ %d events/s", tunedRate), Ours: millis(o.p50), Base: millis(t.p50), Baseline: tunedBase},
			Row{Metric: fmt.Sprintf("p99 ms @ %d events/s", tunedRate), Ours: millis(o.p99), Base: millis(t.p99), Baseline: tunedBase})
		headline := Ratio{Name: "end_to_end_latency_p99", Value: ratio(millis(o.p99), millis(plain[tunedRate].p99))}
		res.Ratios = append([]Ratio{headline}, res.Ratios...)
		res.Ratios = append(res.Ratios, Ratio{Name: "end_to_end_latency_p99_vs_poll_10ms", Value: ratio(millis(o.p99), millis(t.p99))})
		if o.cpuOK && t.cpuOK && plain[tunedRate].cpuOK {
			cpuMetric := fmt.Sprintf("machine CPU ms per event @ %d events/s", tunedRate)
			res.Rows = append(res.Rows,
				Row{Metric: cpuMetric, Ours: o.cpuPerEvent, Base: plain[tunedRate].cpuPerEvent, Baseline: base},
				Row{Metric: cpuMetric, Ours: o.cpuPerEvent, Base: t.cpuPerEvent, Baseline: tunedBase})
			res.Ratios = append(res.Ratios, Ratio{Name: fmt.Sprintf("end_to_end_cpu_per_event_at_%d_vs_poll_10ms", tunedRate), Value: ratio(o.cpuPerEvent, t.cpuPerEvent)})
		}
		if o.procOK && t.procOK {
			res.Rows = append(res.Rows, Row{Metric: fmt.Sprintf("bench process CPU, cores @ %d events/s (%s)", tunedRate, e.pipelineProcess()),
				Ours: o.proc, Base: t.proc, Baseline: tunedBase})
		}
		if o.brokerOK && t.brokerOK {
			res.Rows = append(res.Rows, Row{Metric: fmt.Sprintf("Kafka broker CPU, cores @ %d events/s (pid %d)", tunedRate, e.cfg.BrokerPID),
				Ours: o.broker, Base: t.broker, Baseline: tunedBase})
		}
		po, pp := pipelineCost(o.costs), pipelineCost(plain[tunedRate].costs)
		res.Rows = append(res.Rows, Row{Metric: fmt.Sprintf("round trips per event, whole pipeline @ %d events/s", tunedRate),
			Ours: po.RoundTripsPerEvent(), Base: pp.RoundTripsPerEvent(), Baseline: base})
		res.Ratios = append(res.Ratios, Ratio{Name: fmt.Sprintf("end_to_end_latency_round_trips_per_event_at_%d", tunedRate), Value: ratio(po.RoundTripsPerEvent(), pp.RoundTripsPerEvent())})
	}
	res.Rows = append(res.Rows,
		Row{Metric: fmt.Sprintf("cold start: first event on each of %d new producer connections, p99 ms", e.e2eWorkers()+2),
			Ours: millis(el.coldLatency.summary().p99), Base: millis(pl.coldLatency.summary().p99), Baseline: base},
		Row{Metric: "cold start: producer tx on a new connection, mean ms",
			Ours: millis(el.coldTx.summary().mean), Base: millis(pl.coldTx.summary().mean), Baseline: base})
	var sustainNotes []string
	for _, r := range rates {
		if o := ours[r]; !o.sustained {
			sustainNotes = append(sustainNotes, fmt.Sprintf("eventline @ %d events/s: the producers reached only %.0f events/s: latency from commit hides the rest of the backlog", r, o.achieved))
		}
	}
	res.Rows = append(res.Rows, Row{Metric: "pipeline drain, events/s", Ours: drainRate, Base: plainDrain, Baseline: base})
	if maxRate > 0 {
		res.Rows = append(res.Rows, Row{Metric: fmt.Sprintf("highest rate with p99 ≤ %d ms, events/s", maxRateP99.Milliseconds()),
			Ours: float64(maxRate), Base: drainRate, Baseline: "the same pipeline's drain throughput", Target: "≥ 0.70 " + issue10})
		res.Ratios = append(res.Ratios, Ratio{Name: "end_to_end_latency_max_rate_vs_drain", Value: ratio(float64(maxRate), drainRate)})
	}
	res.Notes = []string{
		fmt.Sprintf("latency = consumer transaction committed − producer transaction committed, same clock; open-loop load at each rate for %s after a %s warm-up, %d producer workers; every event is one order insert + one event, consumed by a handler inserting one row",
			e.sizes.RatePhase, e2eWarmup, e.e2eWorkers()),
		"eventline: PublishTx (8 shards) → Relay (defaults: busy shards polled together every 2ms, idle ones woken by NOTIFY, 5s safety poll) → Kafka → consumer.New runner (tx ▸ dedup ▸ gate); plain: watermill-sql publisher via forwarder.NewPublisher → forwarder with Watermill's default 1s PollInterval (its documented default, kept because a team starting from the docs gets it) → sync kafka.Publisher → watermill-kafka + Router, bare handler",
		fmt.Sprintf("at each rate the designs take turns, which one goes first alternating from rate to rate, so a change in the machine's load hits both; each turn starts its pipeline anew (schema, topic, consumer group) and only one pipeline runs at a time (three would need ~170 connections); the tuned pipeline (PollInterval %s, ~%d idle queries/s, see idle_queries) takes a turn at %d events/s; the rate search and the drains run on pipelines of their own", tunedPollInterval, int(3*time.Second/tunedPollInterval), tunedRate),
		fmt.Sprintf("warm pools: every pool of a pipeline has all its connections open before its first event, and each of the %d producer connections publishes %d events, all at once, before the rate is offered (statements prepared, past the first custom plans; the relay and consumer prepare theirs on those events); the first of those per connection is the cold start rows' sample (all starts together)", e.e2eWorkers()+2, warmRuns),
		fmt.Sprintf("headline end_to_end_latency_p99 is the p99 ratio at %d events/s", tunedRate),
		fmt.Sprintf("machine CPU busy = 1 − (idle+iowait)/total from /proc/stat from each rate's measured phase start until its last event is applied: the whole machine's, other processes included; CPU ms per event = busy cores × that window ÷ the measured events; near 100%% the pipeline is CPU-bound, not waiting; load average (1 5 15 min) at the scenario's start %s, at its end %s", loadStart, loadAvg()),
		"bench process CPU = this process (producers, relay, consumer, and kfake when in-process) over the same window; " + e.brokerCPUNote(),
		"costs (cost table): per stage (each pipeline's producer, relay and consumer pools) over each rate's warm-up and phase until its last event is applied, divided by every event offered at that rate; rows and WAL only for the whole pipeline (its stages share one schema)",
		fmt.Sprintf("a rate is sustained when the producers committed its measured events within the phase plus 10%%; the rate search (full run only) offers 25%% more each step above the highest sustained curve rate with p99 ≤ %s; the drain publishes %d events at once through the running pipeline", maxRateP99, e.drainEvents()),
	}
	res.Notes = append(res.Notes, sustainNotes...)
	return res, nil
}

// pipelineCost returns the "pipeline" row of costs.
func pipelineCost(costs []Cost) Cost {
	for _, c := range costs {
		if c.Stage == "pipeline" {
			return c
		}
	}
	return Cost{}
}

// coldStart is how a pipeline's first events fared: one per producer
// connection, all at once, right after the pipeline started.
type coldStart struct {
	latencies []time.Duration // commit → consumer commit
	txs       []time.Duration // the producer transaction (connection's first)
}

// startPipeline builds a pipeline and warms it: each producer connection
// publishes warmRuns events, all connections at once; the first event of
// each is the cold start sample. It returns when every one was applied.
func (e *env) startPipeline(ctx context.Context, k *kafkaEnv, build func(context.Context, *kafkaEnv) (*pipeline, error)) (*pipeline, error) {
	p, err := build(ctx, k)
	if err != nil {
		return nil, err
	}
	e.progressf("   %s: started; warming up", p.name)
	var (
		mu          sync.Mutex
		first, ids  []string
		tx          latencies
		workerCount = int(p.prodPool.Config().MaxConns)
	)
	err = onEveryConn(ctx, p.prodPool, func(ctx context.Context, c *pgxpool.Conn) error {
		for i := range warmRuns {
			start := time.Now()
			id, err := p.publish(ctx, c)
			if err != nil {
				return err
			}
			mu.Lock()
			if i == 0 {
				tx.add(time.Since(start))
				first = append(first, id)
			}
			ids = append(ids, id)
			mu.Unlock()
		}
		return nil
	})
	if err == nil {
		count := func() int64 { return p.tr.appliedOf(ids) }
		stop := e.watch(p.name+": warm-up", len(ids), count)
		_, err = waitFor(ctx, 2*time.Minute, int64(len(ids)), func() int64 { time.Sleep(10 * time.Millisecond); return count() })
		stop()
	}
	if err != nil {
		e.closePipeline(p)
		return nil, fmt.Errorf("warm-up: %w", err)
	}
	p.cold = coldStart{latencies: p.tr.latencyOf(first), txs: slices.Clone(tx.d)}
	e.progressf("   %s: cold start, first event on each of %d connections: %s; their producer tx %s", p.name, workerCount, summarize(slices.Clone(p.cold.latencies)), tx.summary())
	return p, nil
}

// closePipeline stops p, logging what fails.
func (e *env) closePipeline(p *pipeline) {
	if p == nil || p.close == nil {
		return
	}
	if err := p.close(); err != nil {
		e.progressf("   warning: close %s: %v", p.name, err)
	}
	p.close = nil
}

// offer runs the open-loop load at rate and returns the latencies of the
// events scheduled after the warm-up, the CPU used while they went
// through, and what each stage asked of PostgreSQL.
func (e *env) offer(ctx context.Context, p *pipeline, label string, rate int) (rateResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	variant := fmt.Sprintf("%s @ %d/s", label, rate)
	meters := make([]*meter, 0, len(p.stages)+1)
	for _, s := range p.stages {
		m, err := e.startMeter(ctx, s.name, variant, nil, nil, s.q)
		if err != nil {
			return rateResult{}, err
		}
		meters = append(meters, m)
	}
	whole, err := e.startMeter(ctx, "pipeline", variant, p.schemas, p.pools(), p.counters()...)
	if err != nil {
		return rateResult{}, err
	}
	meters = append(meters, whole)

	stopProfile := e.profile(fmt.Sprintf("end_to_end_latency.%s.%d", profileName(label), rate))
	defer stopProfile()
	type job struct{ measured bool }
	workers := e.e2eWorkers()
	jobs := make(chan job, workers)
	var idsMu sync.Mutex
	var measuredIDs, allIDs []string
	var lagged atomic.Int64
	var txLat latencies
	var lastCommit time.Time
	var wg sync.WaitGroup
	errc := make(chan error, 1)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				start := time.Now()
				id, err := p.publish(ctx, p.prodPool)
				if err != nil {
					select {
					case errc <- err:
					default:
					}
					cancel()
					continue
				}
				now := time.Now()
				idsMu.Lock()
				allIDs = append(allIDs, id)
				if j.measured {
					txLat.add(now.Sub(start))
					measuredIDs = append(measuredIDs, id)
					if now.After(lastCommit) {
						lastCommit = now
					}
				}
				idsMu.Unlock()
			}
		}()
	}
	interval := time.Second / time.Duration(rate)
	total := e2eWarmup + e.sizes.RatePhase
	var startCPU cpuReading
	t0 := time.Now()
	phaseStart := t0.Add(e2eWarmup)
	for i := 0; ; i++ {
		at := t0.Add(time.Duration(i) * interval)
		if at.Sub(t0) >= total || ctx.Err() != nil {
			break
		}
		if d := time.Until(at); d > 0 {
			time.Sleep(d)
		}
		measured := at.Sub(t0) >= e2eWarmup
		if measured && startCPU.at.IsZero() {
			startCPU = e.readCPUs()
		}
		select {
		case jobs <- job{measured: measured}:
		default:
			lagged.Add(1) // every worker busy: the producers fall behind
			jobs <- job{measured: measured}
		}
	}
	close(jobs)
	wg.Wait()
	select {
	case err := <-errc:
		return rateResult{}, err
	default:
	}
	// Wait for the consumer to apply every event offered at this rate.
	count := func() int64 { return p.tr.appliedOf(measuredIDs) }
	stopWatch := e.watch(fmt.Sprintf("%s @ %d/s: applied", label, rate), len(measuredIDs), count)
	_, err = waitFor(ctx, 60*time.Second, int64(len(measuredIDs)), func() int64 {
		time.Sleep(5 * time.Millisecond)
		return count()
	})
	stopWatch()
	if err != nil {
		return rateResult{}, err
	}
	endCPU := e.readCPUs()
	if _, err := waitFor(ctx, 60*time.Second, int64(len(allIDs)), func() int64 {
		time.Sleep(5 * time.Millisecond)
		return p.tr.appliedOf(allIDs)
	}); err != nil {
		return rateResult{}, fmt.Errorf("warm-up events: %w", err)
	}
	var s rateResult
	for _, m := range meters {
		c, err := m.stop(ctx, int64(len(allIDs)), 0)
		if err != nil {
			return rateResult{}, err
		}
		s.costs = append(s.costs, c)
	}

	var d, hop1, hop2 []time.Duration
	p.tr.mu.Lock()
	for _, id := range measuredIDs {
		committed, applied, inKafka := p.tr.committed[id], p.tr.applied[id], p.tr.inKafka[id]
		d = append(d, applied.Sub(committed))
		if !inKafka.IsZero() {
			hop1 = append(hop1, inKafka.Sub(committed))
			hop2 = append(hop2, applied.Sub(inKafka))
		}
	}
	p.tr.mu.Unlock()
	s.summary = summarize(d)
	// The producers kept up when the measured events were all committed
	// within the phase plus a tenth: otherwise the offered rate was not
	// reached and part of the backlog sat in front of the producers,
	// where this latency (from commit) does not see it.
	s.achieved = float64(len(measuredIDs)) / lastCommit.Sub(phaseStart).Seconds()
	s.sustained = lastCommit.Sub(phaseStart) <= e.sizes.RatePhase+e.sizes.RatePhase/10
	s.setCPU(startCPU, endCPU, len(measuredIDs))
	e.progressf("   %s @ %d/s: %s; achieved %.0f/s (sustained %v); %s; load %s",
		label, rate, s, s.achieved, s.sustained, e.describeCPU(s), loadAvg())
	e.progressf("      producer tx %s; all %d workers busy %d times", txLat.summary(), workers, lagged.Load())
	h1, h2 := summarize(hop1), summarize(hop2)
	e.progressf("      commit→Kafka p50=%s p99=%s; Kafka→consumer commit p50=%s p99=%s", ms(h1.p50), ms(h1.p99), ms(h2.p50), ms(h2.p99))
	for _, c := range s.costs {
		e.logCost(c)
	}
	return s, nil
}

func profileName(label string) string {
	out := make([]byte, 0, len(label))
	for _, c := range []byte(label) {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
			out = append(out, c)
		case c >= 'A' && c <= 'Z':
			out = append(out, c+'a'-'A')
		default:
			if len(out) > 0 && out[len(out)-1] != '_' {
				out = append(out, '_')
			}
		}
	}
	return string(out)
}

// goRun runs fn until the returned function cancels it, and returns fn's
// error.
func goRun(ctx context.Context, fn func(context.Context) error) func() error {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	return func() error { cancel(); return <-done }
}
