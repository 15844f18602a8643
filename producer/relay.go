package producer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/time/rate"

	"github.com/eventline/eventline/internal/tracing"
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
	pool    *pgxpool.Pool
	cfg     RelayConfig
	log     *slog.Logger
	wmLog   watermill.LoggerAdapter
	shards  int
	lockNS  int64 // advisory-lock namespace, from the schema name
	metrics *RelayMetrics
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

// ErrRelayRunning is returned by a second call to Relay.Run.
var ErrRelayRunning = errors.New("eventline: relay is already running; create one Relay per Run")

// ErrPoolTooSmall is returned by NewRelay when the pool cannot hold the
// connections a relay needs; the error says how many.
var ErrPoolTooSmall = errors.New("eventline: the relay's pool is too small")

// relayOwnConns is the number of connections a relay uses besides one per
// shard it relays: the ownership connection, the LISTEN connection, and
// one for short statements (idle checks, failure records, cleanup).
const relayOwnConns = 3

// PoolSizeFor returns the pool size (pgxpool MaxConns) a relay needs to
// relay shards shards at once without queueing for connections: one per
// shard plus three.
func PoolSizeFor(shards int) int32 { return int32(shards) + relayOwnConns }

// NewRelay returns a relay for the outbox in cfg.Schema. It reads the shard
// count from the database; it connects to Kafka when Run starts.
//
// The pool needs PoolSizeFor(shards) connections: one per shard the relay
// may own plus three (ownership, LISTEN, and short statements). NewRelay
// refuses a smaller pool with ErrPoolTooSmall naming the size needed.
func NewRelay(ctx context.Context, pool *pgxpool.Pool, cfg RelayConfig) (*Relay, error) {
	if pool == nil {
		return nil, errors.New("eventline: NewRelay needs a *pgxpool.Pool, got nil")
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	shards, err := ReadShardCount(ctx, pool, cfg.Schema)
	if err != nil {
		return nil, err
	}
	if err := checkLeaseTables(ctx, pool, cfg.Schema); err != nil {
		return nil, err
	}
	if have, need := pool.Config().MaxConns, PoolSizeFor(shards); have < need {
		return nil, fmt.Errorf("%w: it allows %d connections, a relay of %d shards needs %d (one per shard plus %d): set pgxpool.Config.MaxConns (or pool_max_conns in the URL) to at least %d",
			ErrPoolTooSmall, have, shards, need, relayOwnConns, need)
	}
	var suffix [4]byte
	_, _ = rand.Read(suffix[:])
	r := &Relay{
		pool:     pool,
		cfg:      cfg,
		log:      cfg.Logger.With("component", "eventline.relay", "relay", cfg.ID),
		shards:   shards,
		lockNS:   lockNamespace(cfg.Schema),
		metrics:  cfg.Metrics,
		tracer:   tracing.New(cfg.TracerProvider, cfg.Propagator),
		running:  map[int]*shardRunner{},
		exited:   make(chan struct{}, 1),
		instance: cfg.ID + "/" + hex.EncodeToString(suffix[:]),
	}
	r.wmLog = newWatermillLog(r.log)
	r.poller = newPoller(r)
	if cfg.MaxPublishRate > 0 {
		burst := max(1, int(cfg.MaxPublishRate/10))
		r.limiter = rate.NewLimiter(rate.Limit(cfg.MaxPublishRate), burst)
	}
	return r, nil
}

// lockNamespace derives an advisory-lock namespace from the schema, so
// outboxes in different schemas of one database do not collide.
func lockNamespace(schema string) int64 {
	h := fnv.New32a()
	_, _ = h.Write([]byte("eventline.relay:" + schema))
	return int64(h.Sum32() & 0x7fffffff)
}

// Shards returns the number of outbox shards.
func (r *Relay) Shards() int { return r.shards }

// OwnedShards returns the shards this relay is relaying now, in order (not
// those it is releasing).
func (r *Relay) OwnedShards() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]int, 0, len(r.running))
	for s, runner := range r.running {
		if !runner.stopping() {
			out = append(out, s)
		}
	}
	slices.Sort(out)
	return out
}

// Run relays until ctx is cancelled, then finishes the batches in flight
// (waiting at most a few seconds for Kafka), releases its shards and
// returns nil. It keeps retrying while Kafka or PostgreSQL are
// unreachable, and returns an error only for problems that retrying cannot
// fix, such as ErrSessionPooling.
func (r *Relay) Run(ctx context.Context) error {
	r.mu.Lock()
	started := r.started
	r.started = true
	r.mu.Unlock()
	if started {
		return ErrRelayRunning
	}
	sink, err := r.connectKafka(ctx)
	if err != nil {
		return err
	}
	if sink == nil {
		return nil // cancelled while waiting for Kafka
	}
	r.sink = sink
	defer func() {
		if err := sink.close(); err != nil {
			r.log.Warn("close Kafka producer", "err", err)
		}
	}()

	// The listener checks first that notifications reach it: behind a
	// transaction-mode pooler they do not, and the relay refuses to run.
	runCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	listening := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := r.listen(runCtx, listening); err != nil {
			cancel(err)
		}
	}()
	select {
	case err := <-listening:
		if err != nil {
			cancel(err)
		}
	case <-runCtx.Done():
	}
	wg.Add(1)
	go func() { defer wg.Done(); r.poller.run(runCtx) }()
	if runCtx.Err() == nil && r.cfg.CleanupInterval > 0 {
		wg.Add(1)
		go func() { defer wg.Done(); r.cleanupLoop(runCtx) }()
	}
	var ownErr error
	if runCtx.Err() == nil {
		if ownErr = r.own(runCtx); ownErr != nil {
			cancel(ownErr)
		}
	}
	cancel(nil)
	wg.Wait()
	if err := context.Cause(runCtx); err != nil && !errors.Is(err, context.Canceled) {
		r.log.Error("relay stopped", "err", err)
		return err
	}
	r.log.Info("relay stopped")
	return nil
}

// connectKafka creates the Kafka producer, retrying while the cluster is
// unreachable. It returns nil, nil if ctx ends first.
func (r *Relay) connectKafka(ctx context.Context) (*kafkaSink, error) {
	wait := 500 * time.Millisecond
	for {
		sink, err := newKafkaSink(r.cfg.Brokers, r.cfg.producerConfig())
		if err == nil {
			return sink, nil
		}
		r.log.Warn("Kafka unreachable; retrying", "brokers", strings.Join(r.cfg.Brokers, ","), "retry_in", wait, "err", err)
		select {
		case <-ctx.Done():
			return nil, nil
		case <-time.After(wait):
		}
		wait = min(2*wait, 30*time.Second)
	}
}

func (r *Relay) pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func (r *Relay) wake(shard int) {
	r.mu.Lock()
	runner := r.running[shard]
	r.mu.Unlock()
	if runner != nil {
		runner.notify()
	}
}

func (r *Relay) wakeAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, runner := range r.running {
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
		owned := r.OwnedShards()
		if len(owned) == 0 {
			continue
		}
		res, err := Cleanup(ctx, r.pool, CleanupConfig{
			Schema: r.cfg.Schema, Retention: r.cfg.RetentionWindow, BatchSize: r.cfg.CleanupBatchSize, Shards: owned,
		})
		if err != nil && ctx.Err() == nil {
			r.log.Warn("outbox cleanup", "err", err)
		}
		if res.Deleted > 0 {
			r.log.Debug("outbox cleanup", "deleted", res.Deleted)
		}
	}
}
