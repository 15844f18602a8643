package eventlinetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/eventlinetest/kafkatest"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/middleware"
)

// redeliverWindow is how many of the records handled before a crash are
// delivered again: those whose offsets were not committed yet.
const redeliverWindow = 3

// pollInterval is how often the end-to-end mode checks progress.
const pollInterval = 20 * time.Millisecond

// batchLinger is the consumers' BatchLinger when the schedule has
// Batches: a free lane waits that long for more records, so the records
// published together reach the handler in batches (with the default, 0,
// only those that queue up while a lane is busy do).
const batchLinger = 20 * time.Millisecond

// checkKafka runs each schedule end to end through Kafka and the ready
// runner.
func (k *kit) checkKafka(ctx context.Context, want any, seeds []uint64, replay bool) (*Failure, error) {
	cluster, err := kafkatest.New(ctx, kafkatest.Config{})
	if err != nil {
		return nil, fmt.Errorf("eventlinetest: %w", err)
	}
	defer cluster.Close()
	for i, seed := range seeds {
		s := k.schedule(seed)
		r, err := k.runKafka(ctx, cluster, s, want)
		if err != nil {
			return nil, err
		}
		if r.failed() {
			// No shrinking: each run takes seconds.
			return k.failure(ctx, s, r, want, i, len(seeds), replay, nil)
		}
	}
	return nil, nil
}

// kafkaRun is one end-to-end trial in progress.
type kafkaRun struct {
	*kit
	brokers      []string
	topic, group string
	batchLinger  time.Duration
	metrics      *middleware.Metrics
	reg          *prometheus.Registry
	inject       *injector

	mu      sync.Mutex
	trace   []string
	running []*runningConsumer
	started int
}

type runningConsumer struct {
	id     int
	cancel context.CancelFunc
	done   chan error
}

func (r *kafkaRun) note(format string, args ...any) {
	r.mu.Lock()
	r.trace = append(r.trace, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

// runKafka runs one schedule: the faulted records are published in
// phases, consumer instances started and stopped between them, and
// records already handled published again, then the state is compared.
func (k *kit) runKafka(ctx context.Context, cluster *kafkatest.Cluster, s schedule, want any) (res *result, err error) {
	ctx, cancel := context.WithTimeout(ctx, k.TrialTimeout)
	defer cancel()
	if err := k.env.reset(ctx); err != nil {
		return nil, err
	}
	r := &kafkaRun{kit: k, brokers: cluster.Brokers, topic: kafkatest.Topic("eventlinetest"), group: kafkatest.Topic(k.Group), inject: k.newInjector(s)}
	r.inject.onRun = func(note string) { r.note("handler ran for %s", note) }
	r.inject.onHookPanic = func(label string) { r.note("the AfterCommit hook of %s panicked (recovered)", label) }
	if countKind(s.faults, Batches) > 0 {
		r.batchLinger = batchLinger
	}
	r.reg = prometheus.NewRegistry()
	if r.metrics, err = middleware.NewMetrics(r.reg); err != nil {
		return nil, err
	}
	if err := cluster.CreateTopics(ctx, int32(s.partitions), r.topic); err != nil {
		return nil, fmt.Errorf("eventlinetest: %w", err)
	}
	defer func() {
		if stopErr := r.stopAll(); stopErr != nil && err == nil {
			res = &result{trace: r.trace, err: stopErr}
		}
	}()

	records := k.publishOrder(s)
	// Phases: the records up to each crash or rebalance, then the rest.
	stops := s.stops(Crashes | Rebalances)
	if err := r.start(); err != nil {
		return nil, err
	}
	published := 0
	fail := func(err error) (*result, error) { return &result{trace: r.trace, err: err}, nil }
	for _, f := range stops {
		upTo := min(f.after, len(records))
		if upTo > published {
			if err := r.publish(ctx, records[published:upTo]); err != nil {
				return nil, err
			}
			published = upTo
		}
		if err := r.waitHandled(ctx, published); err != nil {
			return fail(err)
		}
		switch f.kind {
		case Crashes:
			again := records[max(0, published-redeliverWindow):published]
			r.note("-- crash after %d records: the %d records whose offsets were not committed are delivered again", published, len(again))
			if err := r.publish(ctx, again); err != nil {
				return nil, err
			}
			records = slices.Insert(records, published, again...)
			published += len(again)
		case Rebalances:
			if err := r.start(); err != nil {
				return nil, err
			}
			r.note("-- rebalance after %d records: instance %d joins the group and the oldest instance leaves while it may still be handling events", published, r.started)
			if err := r.stopOldest(); err != nil {
				return fail(err)
			}
		}
	}
	if err := r.publish(ctx, records[published:]); err != nil {
		return nil, err
	}
	if err := r.waitDone(ctx, len(records)); err != nil {
		return fail(err)
	}
	if err := r.stopAll(); err != nil {
		return fail(err)
	}
	if n := r.count("events_dead_lettered_total"); n > 0 {
		return fail(fmt.Errorf("the consumer dead-lettered %d events (see Case.Logger for the reasons)", n))
	}
	return k.compare(ctx, want, r.trace), nil
}

// publishOrder interleaves the schedule's partition logs into the order the
// records are published in. Kafka spreads them over its own partitions
// by key, which keeps each aggregate's records in this order.
func (k *kit) publishOrder(s schedule) []int {
	logs := k.logs(s)
	rng := s.rng()
	var out []int
	for {
		var ps []int
		for p, l := range logs {
			if len(l) > 0 {
				ps = append(ps, p)
			}
		}
		if len(ps) == 0 {
			return out
		}
		p := ps[len(ps)-1]
		if !s.reverse {
			p = ps[rng.IntN(len(ps))]
		}
		out = append(out, logs[p][0])
		logs[p] = logs[p][1:]
	}
}

// start starts a consumer instance in the background.
func (r *kafkaRun) start() error {
	cfg := kafkaconf.Consumer("eventlinetest-" + r.group)
	cfg.Consumer.Group.Rebalance.Timeout = 5 * time.Second
	cfg.Consumer.Group.Session.Timeout = 6 * time.Second
	cfg.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	cfg.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	ccfg := consumer.Config{
		Config: middleware.Config{
			Group: r.group, Schema: r.env.name,
			MaxRetries: maxAttempts - 1, Retry: eventline.Backoff{Initial: 5 * time.Millisecond, Max: 50 * time.Millisecond},
			ParkTimeout: parkTimeout, SweepInterval: 100 * time.Millisecond, Logger: r.Logger, Metrics: r.metrics,
		},
		Brokers: r.brokers, Topics: []string{r.topic}, ShutdownTimeout: 20 * time.Second, SaramaConfig: cfg,
		// Lanes and BatchSize stay the runner's defaults (8, 16): batches
		// are what it does unless told otherwise.
		BatchLinger: r.batchLinger,
	}
	if r.Handler == nil {
		ccfg.Upcasters = r.Upcasters
	}
	c, err := consumer.New(r.env.pool, ccfg)
	if err != nil {
		return fmt.Errorf("eventlinetest: %w", err)
	}
	if r.Handler != nil {
		// A Watermill handler: run it as the middleware would, with the
		// message as received and the upcasting middleware in front.
		var types []string
		for _, e := range r.Events {
			if !slices.Contains(types, e.Type) {
				types = append(types, e.Type)
			}
		}
		for _, t := range types {
			err := c.Handle(t, func(ctx context.Context, _ pgx.Tx, e eventline.Event) error {
				return r.inject.run(ctx, e, func() error {
					_, err := r.inner(r.message(ctx, r.inject.index[e.ID]))
					return err
				})
			})
			if err != nil {
				return err
			}
		}
	} else {
		for t, fn := range r.Handlers {
			err := c.Handle(t, func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
				return r.inject.run(ctx, e, func() error { return fn(ctx, tx, e) })
			})
			if err != nil {
				return err
			}
		}
		if len(r.Ignore) > 0 {
			if err := c.Ignore(r.Ignore...); err != nil {
				return err
			}
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	rc := &runningConsumer{cancel: cancel, done: make(chan error, 1)}
	r.mu.Lock()
	r.started++
	rc.id = r.started
	r.running = append(r.running, rc)
	r.mu.Unlock()
	go func() { rc.done <- c.Run(ctx) }()
	return nil
}

func (r *kafkaRun) stopOldest() error {
	r.mu.Lock()
	if len(r.running) == 0 {
		r.mu.Unlock()
		return nil
	}
	rc := r.running[0]
	r.running = r.running[1:]
	r.mu.Unlock()
	rc.cancel()
	if err := <-rc.done; err != nil {
		return fmt.Errorf("consumer instance %d: %w", rc.id, err)
	}
	return nil
}

func (r *kafkaRun) stopAll() error {
	var errs []error
	for {
		r.mu.Lock()
		n := len(r.running)
		r.mu.Unlock()
		if n == 0 {
			return errors.Join(errs...)
		}
		errs = append(errs, r.stopOldest())
	}
}

// publish writes the records in order.
func (r *kafkaRun) publish(ctx context.Context, records []int) error {
	if len(records) == 0 {
		return nil
	}
	events := make([]eventline.Event, len(records))
	var labels []string
	for i, rec := range records {
		events[i] = r.Events[rec]
		labels = append(labels, fmt.Sprintf("%s/%s v%d", events[i].AggregateType, events[i].AggregateID, events[i].AggregateVersion))
	}
	r.note("publish %s", strings.Join(labels, ", "))
	if err := kafkatest.Publish(ctx, r.brokers, r.topic, events...); err != nil {
		return fmt.Errorf("eventlinetest: %w", err)
	}
	return nil
}

// count sums a consumer counter over all instances.
func (r *kafkaRun) count(name string) int { return int(counters(r.reg)[name]) }

// handled is how many deliveries ended (applied, duplicate, stale or
// parked) or were dead-lettered.
func (r *kafkaRun) handled() int {
	c := counters(r.reg)
	n := c["events_dead_lettered_total"]
	for _, o := range outcomes {
		n += c[o.counter]
	}
	return int(n)
}

func (r *kafkaRun) waitHandled(ctx context.Context, n int) error {
	return r.wait(ctx, fmt.Sprintf("the consumers to handle %d records", n), func() (bool, error) {
		return r.handled() >= n, nil
	})
}

// waitDone waits until every record was handled and every event applied,
// nothing parked.
func (r *kafkaRun) waitDone(ctx context.Context, records int) error {
	store := fmt.Sprintf(`SELECT (SELECT count(*) FROM %s WHERE consumer_group = $1 AND outcome = 'applied'),
		(SELECT count(*) FROM %s WHERE consumer_group = $1)`,
		pgx.Identifier{r.env.name, "processed_events"}.Sanitize(), pgx.Identifier{r.env.name, "parked_events"}.Sanitize())
	return r.wait(ctx, fmt.Sprintf("the consumers to handle all %d records and apply all %d events", records, len(r.Events)), func() (bool, error) {
		if r.count("events_dead_lettered_total") > 0 {
			return true, nil
		}
		if r.handled() < records {
			return false, nil
		}
		var applied, parked int
		if err := r.env.pool.QueryRow(ctx, store, r.group).Scan(&applied, &parked); err != nil {
			return false, err
		}
		return applied >= len(r.Events) && parked == 0, nil
	})
}

func (r *kafkaRun) wait(ctx context.Context, what string, cond func() (bool, error)) error {
	jitter := rand.N(pollInterval / 4)
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("timed out waiting for %s (handled %d; Case.TrialTimeout is %s)", what, r.handled(), r.TrialTimeout)
		case <-time.After(pollInterval + jitter):
		}
	}
}
