package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/producer"
)

// relayShutdownTimeout bounds the metrics server's shutdown.
const relayShutdownTimeout = 5 * time.Second

const relayHelp = `
Relays events from the PostgreSQL outbox (-schema) to Kafka (-brokers) until
it gets SIGINT or SIGTERM, then finishes the batches in flight, releases its
shards and exits 0. A second signal exits at once; nothing is lost either way
(the outbox re-sends what Kafka did not acknowledge).

A relay started while PostgreSQL is unavailable (refusing connections,
restarting, not answering) waits for it, logging a warning at every try and
backing off up to 30s, and starts when it answers; so it does while Kafka is
unreachable (backing off up to 5s). A wrong -database-url, password or -schema (not migrated) fails
at once.

Run as many relays as you like: they share the outbox shards, each shard
relayed by one of them at a time, and take over the shards of one that dies.

A message that fails to publish is retried after a wait of -backoff-initial,
multiplied by -backoff-multiplier at each retry, at most -backoff-max; after
-max-attempts failures it is dead-lettered (see eventline held). Kafka being
unreachable never dead-letters: the relay waits.

Relays need session-level connections (they LISTEN): connect them directly
or through a session-mode pooler; a transaction-mode pooler is refused.

With -metrics-addr it serves Prometheus metrics: the relay's own, the
outbox status (eventline_outbox_*) and, when -schema has the consumer
tables, the consumer groups' status (eventline_group_*; none of those
series on a schema without them). docs/METRICS.md lists them.

Maintenance after moving the database (see the README, "Moving the
database"):
  eventline relay rebase-positions    re-base positions after a restore or a
                                      cutover to a cluster with a lower
                                      transaction counter
  eventline relay advance-sequences   move aggregate sequences past the
                                      versions consumers have seen, after a
                                      failover that lost commits`

func runRelay(ctx context.Context, inv *invocation) error {
	fs := inv.fs
	var cfg producer.RelayConfig
	fs.IntVar(&cfg.BatchSize, "batch-size", producer.DefaultBatchSize, "outbox rows read and published per transaction")
	fs.DurationVar(&cfg.PollInterval, "poll-interval", producer.DefaultPollInterval, "longest an idle shard waits before looking again (inserts wake it at once)")
	fs.Float64Var(&cfg.MaxPublishRate, "max-publish-rate", 0, "most events per second this relay publishes over all its shards; 0 means no cap")
	fs.DurationVar(&cfg.RebalanceInterval, "rebalance-interval", producer.DefaultRebalanceInterval, "how often shard ownership is re-checked (bounds a dead relay's takeover time)")
	fs.DurationVar(&cfg.Backoff.Initial, "backoff-initial", producer.DefaultBackoffInitial, "wait before the first retry of a message that failed to publish")
	fs.Float64Var(&cfg.Backoff.Multiplier, "backoff-multiplier", producer.DefaultBackoffMultiplier, "factor of each later wait over the one before (at least 1)")
	fs.DurationVar(&cfg.Backoff.Max, "backoff-max", producer.DefaultBackoffMax, "longest wait between two retries of a message")
	fs.IntVar(&cfg.MaxAttempts, "max-attempts", producer.DefaultMaxAttempts, "failed publishes of one message before it is dead-lettered")
	fs.DurationVar(&cfg.RetentionWindow, "retention", producer.DefaultRetentionWindow, "how long relayed rows stay in the outbox before cleanup deletes them")
	fs.DurationVar(&cfg.CleanupInterval, "cleanup-interval", producer.DefaultCleanupInterval, "how often this relay deletes expired rows from its shards; 0 disables")
	fs.IntVar(&cfg.CleanupBatchSize, "cleanup-batch", producer.DefaultCleanupBatchSize, "most rows one cleanup statement removes")
	fs.StringVar(&cfg.ID, "id", "", "this relay's name in logs (default <hostname>-<pid>)")
	partitioner := fs.String("partitioner", string(producer.DefaultPartitioner), "how aggregate ids map to Kafka partitions: murmur2 (Kafka's own, as the Java client and franz-go) or fnv1a (Sarama's, the relay's default before murmur2); every relay of one outbox must use the same, see the README before changing it")
	fs.IntVar(&cfg.MaxMessageBytes, "max-message-bytes", producer.DefaultMaxMessageBytes, "largest Kafka record the relay sends; larger events are dead-lettered")
	metricsAddr := fs.String("metrics-addr", "", "serve Prometheus metrics at http://`ADDR`/metrics, e.g. :9090 (default off)")
	if _, err := inv.parse(); err != nil {
		return err
	}
	switch {
	case cfg.BatchSize < 1:
		return usageErrorf("-batch-size must be at least 1, got %d", cfg.BatchSize)
	case cfg.PollInterval <= 0:
		return usageErrorf("-poll-interval must be positive, got %s", cfg.PollInterval)
	case cfg.MaxPublishRate < 0:
		return usageErrorf("-max-publish-rate must not be negative (0 means no cap), got %g", cfg.MaxPublishRate)
	case cfg.RebalanceInterval <= 0:
		return usageErrorf("-rebalance-interval must be positive, got %s", cfg.RebalanceInterval)
	case cfg.Backoff.Initial <= 0:
		return usageErrorf("-backoff-initial must be positive, got %s", cfg.Backoff.Initial)
	case !(cfg.Backoff.Multiplier >= 1):
		return usageErrorf("-backoff-multiplier must be at least 1, got %g", cfg.Backoff.Multiplier)
	case cfg.Backoff.Max < cfg.Backoff.Initial:
		return usageErrorf("-backoff-max (%s) must not be below -backoff-initial (%s)", cfg.Backoff.Max, cfg.Backoff.Initial)
	case cfg.MaxAttempts < 1:
		return usageErrorf("-max-attempts must be at least 1, got %d", cfg.MaxAttempts)
	case cfg.RetentionWindow <= 0:
		return usageErrorf("-retention must be positive, got %s", cfg.RetentionWindow)
	case cfg.CleanupInterval < 0:
		return usageErrorf("-cleanup-interval must not be negative (0 disables cleanup), got %s", cfg.CleanupInterval)
	case cfg.CleanupBatchSize < 1:
		return usageErrorf("-cleanup-batch must be at least 1, got %d", cfg.CleanupBatchSize)
	}
	switch cfg.Partitioner = producer.Partitioner(*partitioner); cfg.Partitioner {
	case producer.PartitionerMurmur2, producer.PartitionerFNV1a:
	default:
		return usageErrorf("-partitioner must be murmur2 or fnv1a, got %q", *partitioner)
	}
	if cfg.MaxMessageBytes < 1 {
		return usageErrorf("-max-message-bytes must be positive, got %d", cfg.MaxMessageBytes)
	}
	if cfg.CleanupInterval == 0 {
		cfg.CleanupInterval = -1 // RelayConfig: negative disables
	}
	g := inv.globals
	var err error
	if cfg.Brokers, err = g.brokerList(); err != nil {
		return usageErrorf("%v", err)
	}
	cfg.Schema = g.schema
	log := inv.logger()
	cfg.Logger = log

	pool, shards, err := inv.openRelayPool(ctx)
	if err != nil {
		return err
	}
	if pool == nil {
		log.Info("relay stopped before the database answered")
		return nil
	}

	runCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if *metricsAddr != "" {
		stop, err := serveMetrics(runCtx, cancel, *metricsAddr, pool, &cfg)
		if err != nil {
			return err
		}
		defer stop()
	}

	relay, err := producer.NewRelay(ctx, pool, cfg)
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted during its checks: a clean stop
		}
		return err
	}
	log.Info("relay started", "schema", cfg.Schema, "shards", shards, "brokers", cfg.Brokers)
	announce := context.AfterFunc(runCtx, func() {
		log.Info("relay stopping: finishing the batches in flight (interrupt again to exit at once)")
	})
	defer announce()
	if err := relay.Run(runCtx); err != nil {
		return fmt.Errorf("relay failed: %w", err)
	}
	// runCtx ended because ctx did (a signal: a clean stop, whatever
	// signal.NotifyContext gives as its cause) or because the metrics
	// server failed (its own cause: a failure).
	if cause := context.Cause(runCtx); cause != nil && cause != context.Cause(ctx) && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return nil
}

// metricsScrapeConns are the connections openRelayPool adds for metrics
// scrapes: the outbox and the consumer groups' status collectors run
// concurrently. The README and docs/OPERATIONS.md state it.
const metricsScrapeConns = 2

// openRelayPool opens a pool large enough for a relay that owns every
// shard (producer.PoolSizeFor: one connection per shard and three for the
// relay's own use) and metricsScrapeConns for metrics scrapes, and returns
// it with the shard count. While the database is unavailable it waits for
// it (waitForDatabase); it returns a nil pool if ctx ends first.
func (inv *invocation) openRelayPool(ctx context.Context) (*pgxpool.Pool, int, error) {
	var pool *pgxpool.Pool
	var shards int
	err := inv.waitForDatabase(ctx, "relaying", func() error {
		conn, err := inv.connectOnce(ctx)
		if err != nil {
			return err
		}
		qctx, cancel := context.WithTimeout(ctx, connectTimeout) // a server that stops answering is unavailable too
		shards, err = admin.ReadShardCount(qctx, conn, inv.globals.schema)
		cancel()
		_ = conn.Close(context.WithoutCancel(ctx))
		if err != nil {
			return err
		}
		pool, err = inv.openPool(ctx, inv.mainDB(), producer.PoolSizeFor(shards)+metricsScrapeConns)
		return err
	})
	if err != nil {
		return nil, 0, err
	}
	if ctx.Err() != nil && pool != nil {
		pool.Close()
		return nil, 0, nil
	}
	return pool, shards, nil
}

// serveMetrics serves the relay's metrics, the outbox status and the
// consumer groups' status (when the schema has the consumer tables, see
// admin.NewStatusCollector) and the Go runtime's collectors at
// addr/metrics, setting cfg.Metrics. A server that fails while running
// cancels ctx through cancel. stop shuts it down.
func serveMetrics(ctx context.Context, cancel context.CancelCauseFunc, addr string, pool *pgxpool.Pool, cfg *producer.RelayConfig) (stop func(), err error) {
	reg := prometheus.NewRegistry()
	if cfg.Metrics, err = producer.NewRelayMetrics(reg); err != nil {
		return nil, err
	}
	status, err := admin.NewStatusCollector(pool, cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	for _, c := range []prometheus.Collector{
		status,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("-metrics-addr %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			cancel(fmt.Errorf("metrics server on %s: %w", addr, err))
		}
	}()
	cfg.Logger.Info("serving metrics", "url", "http://"+ln.Addr().String()+"/metrics")
	return func() {
		sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), relayShutdownTimeout)
		defer scancel()
		_ = srv.Shutdown(sctx)
		<-done
	}, nil
}
