package bench

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
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

// apply records that the consumer committed the event; ctx is the
// consumed message's context.
func (t *tracker) apply(ctx context.Context, id string, at time.Time) {
	ts := middleware.SourceFromContext(ctx).Timestamp
	t.mu.Lock()
	if _, dup := t.applied[id]; !dup {
		t.applied[id] = at
		t.inKafka[id] = ts
	}
	t.mu.Unlock()
}

// pipeline is one design under load: publish runs a business transaction
// that emits one event and returns the event id once committed; the
// pipeline's consumer reports applied events to the tracker.
type pipeline struct {
	publish func(ctx context.Context) (string, error)
	tr      *tracker
	close   func() error
}

// runEndToEndLatency offers fixed event rates to the eventline pipeline and
// to the plain Watermill pipeline and measures commit → consumer commit.
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

	var maxRate int
	var drainRate float64
	ours, err := e.latencyRun(ctx, k, "eventline", rates, e.eventlinePipeline, func(p *pipeline, curve map[int]rateResult) error {
		var err error
		if !e.cfg.Quick && e.cfg.Sizes == nil {
			if maxRate, err = e.rateSearch(ctx, p, "eventline", curve); err != nil {
				return err
			}
		}
		drainRate, err = e.drain(ctx, p, "eventline")
		return err
	})
	if err != nil {
		return Result{}, fmt.Errorf("eventline pipeline: %w", err)
	}
	var plainDrain float64
	plain, err := e.latencyRun(ctx, k, "plain Watermill (poll 1s)", rates, func(ctx context.Context, k *kafkaEnv) (*pipeline, error) {
		return e.plainPipeline(ctx, k, 0)
	}, func(p *pipeline, _ map[int]rateResult) error {
		var err error
		plainDrain, err = e.drain(ctx, p, "plain Watermill (poll 1s)")
		return err
	})
	if err != nil {
		return Result{}, fmt.Errorf("plain Watermill pipeline: %w", err)
	}
	tuned, err := e.latencyRun(ctx, k, "plain Watermill (poll 10ms)", []int{tunedRate}, func(ctx context.Context, k *kafkaEnv) (*pipeline, error) {
		return e.plainPipeline(ctx, k, tunedPollInterval)
	}, nil)
	if err != nil {
		return Result{}, fmt.Errorf("tuned plain Watermill pipeline: %w", err)
	}

	base := "plain Watermill pipeline, default poll interval (1s)"
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
	}
	if o, ok := ours[tunedRate]; ok {
		t := tuned[tunedRate]
		tunedBase := fmt.Sprintf("plain Watermill, PollInterval %s (tuned)", tunedPollInterval)
		res.Rows = append(res.Rows,
			Row{Metric: fmt.Sprintf("p50 ms @ %d events/s", tunedRate), Ours: millis(o.p50), Base: millis(t.p50), Baseline: tunedBase},
			Row{Metric: fmt.Sprintf("p99 ms @ %d events/s", tunedRate), Ours: millis(o.p99), Base: millis(t.p99), Baseline: tunedBase})
		headline := Ratio{Name: "end_to_end_latency_p99", Value: ratio(millis(o.p99), millis(plain[tunedRate].p99))}
		res.Ratios = append([]Ratio{headline}, res.Ratios...)
		res.Ratios = append(res.Ratios, Ratio{Name: "end_to_end_latency_p99_vs_poll_10ms", Value: ratio(millis(o.p99), millis(t.p99))})
	}
	var sustainNotes []string
	for _, r := range rates {
		if o := ours[r]; !o.sustained {
			sustainNotes = append(sustainNotes, fmt.Sprintf("eventline @ %d events/s: the producers reached only %.0f events/s: latency from commit hides the rest of the backlog", r, o.achieved))
		}
	}
	if drainRate > 0 {
		res.Rows = append(res.Rows, Row{Metric: "pipeline drain, events/s", Ours: drainRate, Base: plainDrain, Baseline: "plain Watermill pipeline, default poll interval (1s)"})
		if maxRate > 0 {
			res.Rows = append(res.Rows, Row{Metric: fmt.Sprintf("highest rate with p99 ≤ %d ms, events/s", maxRateP99.Milliseconds()),
				Ours: float64(maxRate), Base: drainRate, Baseline: "the same pipeline's drain throughput", Target: "≥ 0.70 " + issue10})
			res.Ratios = append(res.Ratios, Ratio{Name: "end_to_end_latency_max_rate_vs_drain", Value: ratio(float64(maxRate), drainRate)})
		}
	}
	res.Notes = []string{
		fmt.Sprintf("latency = consumer transaction committed − producer transaction committed, same clock; open-loop load at each rate for %s after a %s warm-up, %d producer workers; every event is one order insert + one event, consumed by a handler inserting one row",
			e.sizes.RatePhase, e2eWarmup, e.e2eWorkers()),
		"eventline: PublishTx (8 shards) → Relay (defaults: busy shards polled together every 2ms, idle ones woken by NOTIFY, 5s safety poll) → Kafka → consumer.New runner (tx ▸ dedup ▸ gate); plain: watermill-sql publisher via forwarder.NewPublisher → forwarder with Watermill's default 1s PollInterval (its documented default, kept because a team starting from the docs gets it) → sync kafka.Publisher → watermill-kafka + Router, bare handler",
		fmt.Sprintf("the tuned row sets the plain forwarder's PollInterval to %s to separate polling delay from the rest; it costs ~%d idle queries/s (see idle_queries)", tunedPollInterval, int(3*time.Second/tunedPollInterval)),
		fmt.Sprintf("headline end_to_end_latency_p99 is the p99 ratio at %d events/s", tunedRate),
		fmt.Sprintf("machine CPU busy = 1 − (idle+iowait)/total from /proc/stat over each rate's measured phase: the whole machine's, other processes included; near 100%% the pipeline is CPU-bound, not waiting; load average (1 5 15 min) at the scenario's start %s, at its end %s", loadStart, loadAvg()),
		fmt.Sprintf("a rate is sustained when the producers committed its measured events within the phase plus 10%%; the rate search (full run only) offers 25%% more each step above the highest sustained curve rate with p99 ≤ %s; the drain publishes %d events at once through the running pipeline", maxRateP99, e.drainEvents()),
	}
	res.Notes = append(res.Notes, sustainNotes...)
	return res, nil
}

// latencyRun starts a pipeline, offers each rate in turn and returns the
// latency summary per rate. extra, if set, runs on the same pipeline after
// the rates (the rate search and the drain measurement).
func (e *env) latencyRun(ctx context.Context, k *kafkaEnv, label string, rates []int, start func(context.Context, *kafkaEnv) (*pipeline, error),
	extra func(*pipeline, map[int]rateResult) error) (map[int]rateResult, error) {
	e.progressf("   %s: starting", label)
	p, err := start(ctx, k)
	if err != nil {
		return nil, err
	}
	defer func() {
		if p.close != nil {
			if err := p.close(); err != nil {
				e.progressf("   warning: close %s: %v", label, err)
			}
		}
	}()
	// Readiness: one event through the whole pipeline (consumer group
	// joined, relay running) before any measurement.
	id, err := p.publish(ctx)
	if err != nil {
		return nil, err
	}
	first := func() int64 {
		p.tr.mu.Lock()
		defer p.tr.mu.Unlock()
		if _, ok := p.tr.applied[id]; ok {
			return 1
		}
		return 0
	}
	stopWatch := e.watch(label+": first event", 1, first)
	_, err = waitFor(ctx, 90*time.Second, 1, first)
	stopWatch()
	if err != nil {
		return nil, fmt.Errorf("pipeline did not deliver a first event: %w", err)
	}
	out := map[int]rateResult{}
	for _, rate := range rates {
		s, err := e.offer(ctx, p, label, rate)
		if err != nil {
			return nil, err
		}
		out[rate] = s
	}
	if extra != nil {
		if err := extra(p, out); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// offer runs the open-loop load at rate and returns the latencies of the
// events scheduled after the warm-up.
func (e *env) offer(ctx context.Context, p *pipeline, label string, rate int) (rateResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stopProfile := e.profile(fmt.Sprintf("end_to_end_latency.%s.%d", profileName(label), rate))
	defer stopProfile()
	type job struct{ measured bool }
	workers := e.e2eWorkers()
	jobs := make(chan job, workers)
	var measured sync.Map // event id → true, for events scheduled after the warm-up
	var nMeasured, lagged atomic.Int64
	var txLat latencies
	var commitMu sync.Mutex
	var lastCommit time.Time
	var wg sync.WaitGroup
	errc := make(chan error, 1)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				start := time.Now()
				id, err := p.publish(ctx)
				if err != nil {
					select {
					case errc <- err:
					default:
					}
					cancel()
					continue
				}
				if j.measured {
					txLat.add(time.Since(start))
					measured.Store(id, true)
					nMeasured.Add(1)
					commitMu.Lock()
					if now := time.Now(); now.After(lastCommit) {
						lastCommit = now
					}
					commitMu.Unlock()
				}
			}
		}()
	}
	interval := time.Second / time.Duration(rate)
	total := e2eWarmup + e.sizes.RatePhase
	var cpuStart cpuTimes
	var cpuStartOK bool
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
		if !cpuStartOK && at.Sub(t0) >= e2eWarmup {
			cpuStart, cpuStartOK = readCPU()
		}
		select {
		case jobs <- job{measured: at.Sub(t0) >= e2eWarmup}:
		default:
			lagged.Add(1) // every worker busy: the producers fall behind
			jobs <- job{measured: at.Sub(t0) >= e2eWarmup}
		}
	}
	close(jobs)
	wg.Wait()
	cpuEnd, cpuEndOK := readCPU()
	select {
	case err := <-errc:
		return rateResult{}, err
	default:
	}
	// Wait for the consumer to apply every measured event.
	want := nMeasured.Load()
	count := func() int64 {
		var n int64
		p.tr.mu.Lock()
		defer p.tr.mu.Unlock()
		measured.Range(func(k, _ any) bool {
			if _, ok := p.tr.applied[k.(string)]; ok {
				n++
			}
			return true
		})
		return n
	}
	stopWatch := e.watch(fmt.Sprintf("%s @ %d/s: applied", label, rate), int(want), count)
	_, err := waitFor(ctx, 60*time.Second, want, func() int64 {
		time.Sleep(50 * time.Millisecond)
		return count()
	})
	stopWatch()
	if err != nil {
		return rateResult{}, err
	}
	var d, hop1, hop2 []time.Duration
	p.tr.mu.Lock()
	measured.Range(func(k, _ any) bool {
		id := k.(string)
		committed, applied, inKafka := p.tr.committed[id], p.tr.applied[id], p.tr.inKafka[id]
		d = append(d, applied.Sub(committed))
		if !inKafka.IsZero() {
			hop1 = append(hop1, inKafka.Sub(committed))
			hop2 = append(hop2, applied.Sub(inKafka))
		}
		return true
	})
	p.tr.mu.Unlock()
	s := rateResult{summary: summarize(d)}
	// The producers kept up when the measured events were all committed
	// within the phase plus a tenth: otherwise the offered rate was not
	// reached and part of the backlog sat in front of the producers,
	// where this latency (from commit) does not see it.
	s.achieved = float64(nMeasured.Load()) / lastCommit.Sub(phaseStart).Seconds()
	s.sustained = lastCommit.Sub(phaseStart) <= e.sizes.RatePhase+e.sizes.RatePhase/10
	if cpuStartOK && cpuEndOK {
		s.cpu, s.cpuOK = cpuBetween(cpuStart, cpuEnd), true
	}
	e.progressf("   %s @ %d/s: %s; achieved %.0f/s (sustained %v); machine CPU %.0f%% busy (%.2f cores), load %s",
		label, rate, s, s.achieved, s.sustained, 100*s.cpu.busy, s.cpu.cores, loadAvg())
	e.progressf("      producer tx %s; all %d workers busy %d times", txLat.summary(), workers, lagged.Load())
	h1, h2 := summarize(hop1), summarize(hop2)
	e.progressf("      commit→Kafka p50=%s p99=%s; Kafka→consumer commit p50=%s p99=%s", ms(h1.p50), ms(h1.p99), ms(h2.p50), ms(h2.p99))
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

// eventlinePipeline starts PublishTx → Relay → Kafka → consumer.New.
func (e *env) eventlinePipeline(ctx context.Context, k *kafkaEnv) (*pipeline, error) {
	schema, drop, err := e.newEventlineSchema(ctx, "e2e_el", relayShards)
	if err != nil {
		return nil, err
	}
	p := &pipeline{tr: newTracker()}
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

	orders, effects := sqlident.Qualify(schema, "orders"), sqlident.Qualify(schema, "effects")
	if err := e.exec(ctx, fmt.Sprintf(ordersDDL, orders), fmt.Sprintf(effectsDDL, effects)); err != nil {
		return fail(err)
	}
	topic, err := k.topic("e2e-el")
	if err != nil {
		return fail(err)
	}
	prodPool, err := e.openPool(ctx, int32(e.e2eWorkers())+2, nil)
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
	p.publish = func(ctx context.Context) (string, error) {
		ev, err := w.tx(ctx, publishTx)
		if err != nil {
			return "", err
		}
		p.tr.commit(ev.ID, time.Now())
		return ev.ID, nil
	}

	relayPool, err := e.openPool(ctx, relayShards+4, nil)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { relayPool.Close(); return nil })
	relay, err := producer.NewRelay(ctx, relayPool, producer.RelayConfig{Schema: schema, Brokers: k.brokers, ID: "bench", Logger: quiet})
	if err != nil {
		return fail(err)
	}
	closers = append(closers, goRun(ctx, relay.Run))

	consPool, err := e.consumerPool(ctx)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { consPool.Close(); return nil })
	cons, err := consumer.New(consPool, consumer.Config{Brokers: k.brokers, Group: "bench-e2e-el", Topics: []string{topic}, Schema: schema, Logger: quiet})
	if err != nil {
		return fail(err)
	}
	biz := business{insert: fmt.Sprintf(insertEffectSQL, effects)}
	err = cons.Handle("order.created", func(ctx context.Context, tx pgx.Tx, ev eventline.Event) error {
		if err := biz.apply(ctx, tx, ev); err != nil {
			return err
		}
		middleware.AfterCommit(ctx, func() { p.tr.apply(ctx, ev.ID, time.Now()) })
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
	p := &pipeline{tr: newTracker()}
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

	orders, effects := sqlident.Qualify(o.schema, "orders"), sqlident.Qualify(o.schema, "effects")
	if err := e.exec(ctx, fmt.Sprintf(ordersDDL, orders), fmt.Sprintf(effectsDDL, effects)); err != nil {
		return fail(err)
	}
	topic, err := k.topic("e2e-plain")
	if err != nil {
		return fail(err)
	}
	prodPool, err := e.openPool(ctx, int32(e.e2eWorkers())+2, nil)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { prodPool.Close(); return nil })
	insertOrder := fmt.Sprintf(insertOrderSQL, orders)
	var seq atomic.Int64
	p.publish = func(ctx context.Context) (string, error) {
		n := int(seq.Add(1))
		var id string
		err := pgx.BeginFunc(ctx, prodPool, func(tx pgx.Tx) error {
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

	relayPool, err := e.openPool(ctx, 4, nil)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { relayPool.Close(); return nil })
	relay, err := o.startPlainRelay(ctx, relayPool, k.brokers, pollInterval)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { relay.close(); return nil })

	consPool, err := e.consumerPool(ctx)
	if err != nil {
		return fail(err)
	}
	closers = append(closers, func() error { consPool.Close(); return nil })
	biz := business{insert: fmt.Sprintf(insertEffectSQL, effects)}
	stop, err := e.routerConsumer(ctx, k, topic, "bench-e2e-plain", nil, func(msg *message.Message) error {
		ev, err := eventline.Decode(msg)
		if err != nil {
			return err
		}
		if err := pgx.BeginFunc(msg.Context(), consPool, func(tx pgx.Tx) error { return biz.apply(msg.Context(), tx, ev) }); err != nil {
			return err
		}
		p.tr.apply(msg.Context(), ev.ID, time.Now())
		return nil
	})
	if err != nil {
		return fail(err)
	}
	closers = append(closers, stop)
	return p, nil
}

// goRun runs fn until the returned function cancels it, and returns fn's
// error.
func goRun(ctx context.Context, fn func(context.Context) error) func() error {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	return func() error { cancel(); return <-done }
}
