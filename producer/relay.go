package producer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/time/rate"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgerr"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/internal/wmlog"
)

type watermillLogger = watermill.LoggerAdapter

// Relay moves events from the outbox to Kafka. Run it in one or more
// processes: relays share the outbox's shards between them through leases
// in PostgreSQL (relay_leases), each shard relayed by exactly one of them
// at a time, and take over the shards of a relay that stops, dies or
// vanishes within TakeoverBound(RebalanceInterval).
//
// Within a shard, rows are published in outbox order (transaction id, then
// insert order) and the relay records its position only after Kafka
// acknowledged every row before it, so a crash re-sends but never skips.
//
// A relay needs session-level database connections (it LISTENs for
// inserts): connect it to PostgreSQL directly or through a pooler in
// session mode. Run refuses a transaction-mode pooler (ErrSessionPooling).
type Relay struct {
	pool  *pgxpool.Pool
	cfg   RelayConfig
	log   *slog.Logger
	wmLog watermill.LoggerAdapter
	// shards is the outbox's shard count, 0 until the outbox was checked
	// (checkOutbox): by NewRelay, or by Run when NewRelay found the
	// database unavailable. Written under mu before Run starts anything.
	shards  int
	metrics *RelayMetrics
	held    *held.Store // where dead letters go
	limiter *rate.Limiter
	sink    *kafkaSink
	tracer  *tracing.Tracer // nil: tracing off
	// instance names this Run in relay_members and relay_leases: the ID
	// plus a random suffix, so two relays given one ID stay apart.
	instance string

	poller *poller

	mu      sync.Mutex
	started bool
	running map[int]*shardRunner
	// exited is signalled when a shard runner ends, so the ownership loop
	// settles its lease at once.
	exited chan struct{}
}

// relayOwnConns is the number of connections a relay uses besides one per
// shard it relays: the ownership connection, the LISTEN connection, and
// one for short statements (idle checks, failure records, cleanup).
const relayOwnConns = 3

// PoolSizeFor returns the pool size (pgxpool MaxConns) a relay needs to
// relay shards shards at once without queueing for connections: one per
// shard plus three.
func PoolSizeFor(shards int) int32 { return int32(shards) + relayOwnConns }

// NewRelay returns a relay for the outbox in cfg.Schema. It checks the
// outbox (its shard count, the relay's tables, the pool's size) in the
// database; it connects to Kafka when Run starts.
//
// Configuration mistakes fail at once: an invalid cfg, a schema that is not
// migrated (ErrNotMigrated), a pool smaller than PoolSizeFor(shards)
// connections (ErrPoolTooSmall, naming the size needed: one per shard the
// relay may own plus three, for ownership, LISTEN and short statements).
//
// A database that is unavailable is not a mistake: when the checks fail
// because PostgreSQL refuses connections, resets them or does not answer
// within a few seconds, NewRelay logs a warning and returns the relay
// anyway; Run then waits for the database, backing off, and makes the
// checks before relaying (their configuration errors are then Run's). A relay process started during a
// database restart or failover thus starts relaying when the database
// answers, and stops cleanly if asked to before. NewRelay still returns
// the error if ctx ends during the checks.
func NewRelay(ctx context.Context, pool *pgxpool.Pool, cfg RelayConfig) (*Relay, error) {
	if pool == nil {
		return nil, errors.New("eventline: NewRelay needs a *pgxpool.Pool, got nil")
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	var suffix [4]byte
	_, _ = rand.Read(suffix[:])
	r := &Relay{
		pool:     pool,
		cfg:      cfg,
		log:      cfg.Logger.With("component", "eventline.relay", "relay", cfg.ID),
		metrics:  cfg.Metrics,
		held:     held.New(cfg.Schema),
		tracer:   tracing.New(cfg.TracerProvider, cfg.Propagator),
		running:  map[int]*shardRunner{},
		exited:   make(chan struct{}, 1),
		instance: cfg.ID + "/" + hex.EncodeToString(suffix[:]),
	}
	r.wmLog = wmlog.New(r.log)
	r.poller = newPoller(r)
	if cfg.MaxPublishRate > 0 {
		burst := max(1, int(cfg.MaxPublishRate/10))
		r.limiter = rate.NewLimiter(rate.Limit(cfg.MaxPublishRate), burst)
	}
	if err := r.checkOutbox(ctx); err != nil {
		if ctx.Err() != nil || !dbUnavailable(err) {
			return nil, err
		}
		r.log.Warn("PostgreSQL is unavailable; Run will wait for it and check the outbox before relaying",
			"schema", cfg.Schema, "err", err)
	}
	return r, nil
}

// outboxCheckTimeout bounds one attempt of checkOutbox, so a database that
// does not answer counts as unavailable instead of hanging the caller.
const outboxCheckTimeout = 10 * time.Second

// checkOutbox reads the shard count, checks the relay's tables and the
// pool's size, and records the shard count.
func (r *Relay) checkOutbox(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, outboxCheckTimeout)
	defer cancel()
	shards, err := outbox.ShardCount(cctx, r.pool, r.cfg.Schema)
	if err == nil {
		err = outbox.CheckRelayTables(cctx, r.pool, r.cfg.Schema)
	}
	if err != nil {
		if cctx.Err() != nil && ctx.Err() == nil {
			return fmt.Errorf("%w within %s: %w", errNoAnswer, outboxCheckTimeout, err)
		}
		return err
	}
	if have, need := r.pool.Config().MaxConns, PoolSizeFor(shards); have < need {
		return fmt.Errorf("%w: it allows %d connections, a relay of %d shards needs %d (one per shard plus %d): set pgxpool.Config.MaxConns (or pool_max_conns in the URL) to at least %d",
			ErrPoolTooSmall, have, shards, need, relayOwnConns, need)
	}
	r.mu.Lock()
	r.shards = shards
	r.mu.Unlock()
	return nil
}

// dbUnavailable reports whether err says PostgreSQL is unavailable (down,
// restarting, refusing or dropping connections, not answering) rather than
// misconfigured: the classification the consumer uses too (pgerr).
func dbUnavailable(err error) bool {
	if errors.Is(err, ErrNotMigrated) || errors.Is(err, ErrPoolTooSmall) {
		return false
	}
	return errors.Is(err, errNoAnswer) || pgerr.Unavailable(err)
}

// errNoAnswer marks an outbox check that PostgreSQL did not answer in time.
var errNoAnswer = errors.New("no answer from PostgreSQL")

// databaseWait is how a relay waits for an unavailable database: 500ms,
// doubling, at most 30s.
var databaseWait = eventline.Backoff{Initial: 500 * time.Millisecond, Multiplier: 2, Max: 30 * time.Second}

// waitForOutbox makes the outbox checks NewRelay could not make, waiting
// for the database with backoff while it is unavailable. It returns nil
// once they pass or when ctx ends first (then r.shards is still 0), and
// the checks' error when it is not an outage (ErrNotMigrated…).
func (r *Relay) waitForOutbox(ctx context.Context) error {
	return backoff.Retry(ctx, databaseWait, dbUnavailable, func(wait time.Duration, err error) {
		r.log.Warn("PostgreSQL is unavailable; waiting for it before relaying", "schema", r.cfg.Schema, "retry_in", wait, "err", err)
	}, func() error { return r.checkOutbox(ctx) })
}

// shardCount returns the number of outbox shards, or 0 while it is not
// known: NewRelay found the database unavailable and Run has not reached it
// yet.
func (r *Relay) shardCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.shards
}

// runners returns a copy of the shard runners, by shard.
func (r *Relay) runners() map[int]*shardRunner {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.running)
}

// ownedShards returns the shards this relay is relaying now, in order (not
// those it is releasing).
func (r *Relay) ownedShards() []int {
	var out []int
	for s, runner := range r.runners() {
		if !runner.stopping() {
			out = append(out, s)
		}
	}
	slices.Sort(out)
	return out
}

// Run relays until ctx ends (cancelled, or its deadline passed: either is
// the caller's request to stop), then finishes the batches in flight
// (waiting at most a few seconds for Kafka), releases its shards, logs
// "relay stopped" at INFO and returns nil. It keeps retrying while Kafka
// or PostgreSQL are unreachable; if NewRelay found the database
// unavailable, Run first waits for it (logging a warning at every try)
// and checks the outbox. It logs "relay stopped" at ERROR and returns an
// error only for problems that retrying cannot fix, such as
// ErrSessionPooling, or ErrNotMigrated found by those checks.
func (r *Relay) Run(ctx context.Context) error {
	r.mu.Lock()
	started, checked := r.started, r.shards > 0
	r.started = true
	r.mu.Unlock()
	if started {
		return ErrRelayRunning
	}
	if !checked {
		if err := r.waitForOutbox(ctx); err != nil {
			r.log.Error("relay stopped", "err", err)
			return err
		}
		if ctx.Err() != nil {
			r.log.Info("relay stopped before the database answered")
			return nil
		}
		r.log.Info("PostgreSQL answers; the outbox is ready", "schema", r.cfg.Schema, "shards", r.shardCount())
	}
	sink := r.connectKafka(ctx)
	if sink == nil {
		return nil // cancelled while waiting for Kafka
	}
	r.sink = sink
	defer sink.close()

	// The listener checks first that notifications reach it: behind a
	// transaction-mode pooler they do not, and the relay refuses to run.
	runCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	listening := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := r.listen(runCtx, listening); err != nil {
			cancel(err)
		}
	})
	select {
	case err := <-listening:
		if err != nil {
			cancel(err)
		}
	case <-runCtx.Done():
	}
	wg.Go(func() { r.poller.run(runCtx) })
	if runCtx.Err() == nil && r.cfg.CleanupInterval > 0 {
		wg.Go(func() { r.cleanupLoop(runCtx) })
	}
	if runCtx.Err() == nil {
		if err := r.own(runCtx); err != nil {
			cancel(err)
		}
	}
	cancel(nil)
	wg.Wait()
	if err := stopCause(ctx, runCtx); err != nil {
		r.log.Error("relay stopped", "err", err)
		return err
	}
	r.log.Info("relay stopped")
	return nil
}

// stopCause returns why runCtx, Run's context derived from the caller's
// ctx, ended, or nil when it was a requested stop: the caller's ctx ended
// first (cancelled, past its deadline, with or without a cause), or Run
// cancelled it without a cause on its way out.
func stopCause(ctx, runCtx context.Context) error {
	cause := context.Cause(runCtx)
	switch {
	case cause == nil, errors.Is(cause, context.Canceled) && ctx.Err() == nil:
		return nil
	case ctx.Err() != nil && cause == context.Cause(ctx):
		return nil
	}
	return cause
}

// kafkaWait is how a relay waits for unreachable Kafka brokers: 500ms,
// doubling, at most maxUnavailableWait.
var kafkaWait = eventline.Backoff{Initial: 500 * time.Millisecond, Multiplier: 2, Max: maxUnavailableWait}

// connectKafka creates the Kafka producer, retrying while the cluster is
// unreachable. It returns nil if ctx ends first.
func (r *Relay) connectKafka(ctx context.Context) *kafkaSink {
	var sink *kafkaSink
	_ = backoff.Retry(ctx, kafkaWait, func(error) bool { return true }, func(wait time.Duration, err error) {
		r.log.Warn("Kafka unreachable; retrying", "brokers", strings.Join(r.cfg.Brokers, ","), "retry_in", wait, "err", err)
	}, func() (err error) {
		sink, err = newKafkaSink(r.cfg.Brokers, r.cfg.producerConfig())
		return err
	})
	return sink
}

func (r *Relay) wake(shard int) {
	if runner := r.runner(shard); runner != nil {
		runner.notify()
	}
}

func (r *Relay) wakeAll() {
	for _, runner := range r.runners() {
		runner.notify()
	}
}

// cleanupLoop deletes expired, acknowledged rows from the owned shards.
func (r *Relay) cleanupLoop(ctx context.Context) {
	ticker := time.NewTicker(r.cfg.CleanupInterval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
		owned := r.ownedShards()
		if len(owned) == 0 {
			continue
		}
		deleted, err := outbox.Clean(ctx, r.pool, r.cfg.Schema, owned, r.cfg.RetentionWindow, r.cfg.CleanupBatchSize, 0)
		if err != nil && ctx.Err() == nil {
			r.log.Warn("outbox cleanup", "err", err)
		}
		var n int64
		for _, d := range deleted {
			n += d
		}
		if n > 0 {
			r.log.Debug("outbox cleanup", "deleted", n)
		}
	}
}
