package producer

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/time/rate"

	"github.com/eventline/eventline/internal/outbox"
)

type watermillLogger = watermill.LoggerAdapter

// membershipKey is the second advisory-lock key every running relay holds
// in shared mode; shard locks use the shard number.
const membershipKey = 1<<31 - 1

// Relay moves events from the outbox to Kafka. Run it in one or more
// processes: relays share the outbox's shards between them through
// PostgreSQL advisory locks, each shard relayed by exactly one of them at a
// time, and take over the shards of a relay that dies.
//
// Within a shard, rows are published in outbox order (transaction id, then
// insert order) and the relay records its position only after Kafka
// acknowledged every row before it, so a crash re-sends but never skips.
type Relay struct {
	pool    *pgxpool.Pool
	cfg     RelayConfig
	log     *slog.Logger
	wmLog   watermill.LoggerAdapter
	shards  int
	lockNS  int64 // first advisory-lock key, from the schema name
	metrics *RelayMetrics
	limiter *rate.Limiter
	sink    *kafkaSink

	mu      sync.Mutex
	started bool
	running map[int]*shardRunner
}

// ErrRelayRunning is returned by a second call to Relay.Run.
var ErrRelayRunning = errors.New("eventline: relay is already running; create one Relay per Run")

// NewRelay returns a relay for the outbox in cfg.Schema. It reads the shard
// count from the database; it connects to Kafka when Run starts.
//
// The pool needs one connection per shard the relay may own plus three (one
// holds the ownership locks, one listens for inserts, one is shared).
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
	if max := pool.Config().MaxConns; max < 4 {
		return nil, fmt.Errorf("eventline: the relay's pool allows %d connections; it needs at least 4 (one per owned shard plus three)", max)
	}
	r := &Relay{
		pool:    pool,
		cfg:     cfg,
		log:     cfg.Logger.With("component", "eventline.relay", "relay", cfg.ID),
		shards:  shards,
		lockNS:  lockNamespace(cfg.Schema),
		metrics: cfg.Metrics,
		running: map[int]*shardRunner{},
	}
	r.wmLog = newWatermillLog(r.log)
	if cfg.MaxPublishRate > 0 {
		burst := max(1, int(cfg.MaxPublishRate/10))
		r.limiter = rate.NewLimiter(rate.Limit(cfg.MaxPublishRate), burst)
	}
	return r, nil
}

// lockNamespace derives the advisory-lock namespace from the schema, so
// outboxes in different schemas of one database do not collide.
func lockNamespace(schema string) int64 {
	h := fnv.New32a()
	_, _ = h.Write([]byte("eventline.relay:" + schema))
	return int64(h.Sum32() & 0x7fffffff)
}

// Shards returns the number of outbox shards.
func (r *Relay) Shards() int { return r.shards }

// OwnedShards returns the shards this relay is relaying now, in order.
func (r *Relay) OwnedShards() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]int, 0, len(r.running))
	for s := range r.running {
		out = append(out, s)
	}
	slices.Sort(out)
	return out
}

// Run relays until ctx is cancelled, then finishes the batches in flight,
// releases its shards and returns nil. It keeps retrying while Kafka or
// PostgreSQL are unreachable, and returns an error only for problems that
// retrying cannot fix.
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

	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); r.listen(ctx) }()
	if r.cfg.CleanupInterval > 0 {
		wg.Add(1)
		go func() { defer wg.Done(); r.cleanupLoop(ctx) }()
	}
	r.own(ctx)
	wg.Wait()
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

// own keeps this relay's fair share of shards until ctx ends. Ownership is
// a session advisory lock per shard on one dedicated connection; every
// relay also holds a shared membership lock, so counting its holders
// counts the live relays. When that connection drops, every lock is gone,
// so the relay stops all its shards before trying again.
func (r *Relay) own(ctx context.Context) {
	defer r.stopAll()
	for ctx.Err() == nil {
		conn, err := r.pool.Acquire(ctx)
		if err != nil {
			if ctx.Err() == nil {
				r.log.Warn("acquire ownership connection; retrying", "err", err)
				r.pause(ctx, time.Second)
			}
			continue
		}
		r.ownOn(ctx, conn)
		r.stopAll()
		// The session's locks go with it: close it rather than returning
		// it to the pool still holding them.
		_ = conn.Conn().Close(context.Background())
		conn.Release()
		r.pause(ctx, time.Second)
	}
}

func (r *Relay) ownOn(ctx context.Context, conn *pgxpool.Conn) {
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock_shared($1::int, $2::int)`, r.lockNS, membershipKey); err != nil {
		if ctx.Err() == nil {
			r.log.Warn("join relay membership; retrying", "err", err)
		}
		return
	}
	start := rand.IntN(r.shards) // spread relays over different shards first
	ticker := time.NewTicker(r.cfg.RebalanceInterval)
	defer ticker.Stop()
	for {
		if err := r.rebalance(ctx, conn, start); err != nil {
			if ctx.Err() == nil {
				r.log.Warn("ownership connection failed; releasing all shards", "err", err)
			}
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
	}
}

// rebalance moves this relay's shard count towards its fair share,
// ceil(shards / live relays): it releases shards above the share and takes
// free ones below it.
func (r *Relay) rebalance(ctx context.Context, conn *pgxpool.Conn, start int) error {
	var live int
	err := conn.QueryRow(ctx, `SELECT count(DISTINCT pid) FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND objsubid = 2
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND classid::bigint = $1 AND objid::bigint = $2`, r.lockNS, membershipKey).Scan(&live)
	if err != nil {
		return fmt.Errorf("count live relays: %w", err)
	}
	live = max(live, 1)
	share := (r.shards + live - 1) / live
	r.metrics.setLiveRelays(live)

	owned := r.OwnedShards()
	for len(owned) > share {
		shard := owned[len(owned)-1]
		owned = owned[:len(owned)-1]
		r.release(shard)
		if _, err := conn.Exec(ctx, `SELECT pg_advisory_unlock($1::int, $2::int)`, r.lockNS, shard); err != nil {
			return fmt.Errorf("release shard %d: %w", shard, err)
		}
		r.log.Info("released shard to rebalance", "shard", shard, "live_relays", live)
	}
	for i := 0; i < r.shards && len(owned) < share; i++ {
		shard := (start + i) % r.shards
		if slices.Contains(owned, shard) {
			continue
		}
		var got bool
		if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1::int, $2::int)`, r.lockNS, shard).Scan(&got); err != nil {
			return fmt.Errorf("lock shard %d: %w", shard, err)
		}
		if !got {
			continue
		}
		runner, err := r.startShard(ctx, shard)
		if err != nil {
			r.log.Warn("start shard", "shard", shard, "err", err)
			if _, err := conn.Exec(ctx, `SELECT pg_advisory_unlock($1::int, $2::int)`, r.lockNS, shard); err != nil {
				return err
			}
			continue
		}
		r.mu.Lock()
		r.running[shard] = runner
		r.mu.Unlock()
		owned = append(owned, shard)
		r.log.Info("took shard", "shard", shard, "live_relays", live)
	}
	r.metrics.setOwnedShards(len(owned))
	return nil
}

// release stops relaying shard, after its batch in flight settles.
func (r *Relay) release(shard int) {
	r.mu.Lock()
	runner := r.running[shard]
	delete(r.running, shard)
	r.mu.Unlock()
	if runner != nil {
		runner.close()
	}
}

// stopAll stops every shard concurrently.
func (r *Relay) stopAll() {
	var wg sync.WaitGroup
	for _, shard := range r.OwnedShards() {
		wg.Add(1)
		go func() { defer wg.Done(); r.release(shard) }()
	}
	wg.Wait()
	r.metrics.setOwnedShards(0)
}

func (r *Relay) pause(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// listen wakes idle shards when their tables get rows: every outbox table
// NOTIFYs "<schema>.<shard>" on insert. After a reconnect it wakes every
// shard, since notifications may have been missed.
func (r *Relay) listen(ctx context.Context) {
	prefix := r.cfg.Schema + "."
	for ctx.Err() == nil {
		conn, err := r.pool.Acquire(ctx)
		if err != nil {
			r.pause(ctx, time.Second)
			continue
		}
		_, err = conn.Exec(ctx, `LISTEN `+outbox.NotifyChannel)
		r.wakeAll()
		for err == nil {
			var n *pgconn.Notification
			n, err = conn.Conn().WaitForNotification(ctx)
			if err == nil && strings.HasPrefix(n.Payload, prefix) {
				if shard, convErr := strconv.Atoi(n.Payload[len(prefix):]); convErr == nil {
					r.wake(shard)
				}
			}
		}
		if ctx.Err() == nil {
			r.log.Debug("outbox listener reconnecting", "err", err)
		}
		// A connection that was listening is closed, not returned to the
		// pool, so no other user inherits the LISTEN.
		_ = conn.Conn().Close(context.Background())
		conn.Release()
		r.pause(ctx, 100*time.Millisecond)
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
