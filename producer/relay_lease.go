package producer

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/internal/sqlident"
)

// Ownership is a lease per shard in relay_leases, with an expiry in
// PostgreSQL's clock that the owner renews every RebalanceInterval. Another
// relay takes a shard only once its lease has expired. The owner measures
// its own lease from the moment it sent the renewal, in its own monotonic
// clock, and shorter (leaseValidIntervals against leaseTTLIntervals): so it
// stops relaying a shard it could not renew before anyone else may take
// it, whatever happened to its connection. Every ownership statement has a
// deadline, and the ownership connection asks PostgreSQL to end the
// session itself when its peer stops answering (sessionSettings).
//
// Leases make takeovers timely; they are not what keeps positions safe.
// That is the per-transaction advisory fence on each shard read
// (relayOffsetsAdapter) together with REPEATABLE READ: two relays that
// both believe they own a shard never read it at the same time, and a
// position written by one makes the other's stale write fail.

// leaseSQL holds the ownership statements for one schema.
type leaseSQL struct {
	renew, live, free, take, release, leave string
}

func newLeaseSQL(schema string) leaseSQL {
	q := func(query string) string { return sqlident.SQL(schema, query) }
	return leaseSQL{
		// $1 instance, $2 relay id, $3 lease seconds. Renews the member row
		// and every unexpired lease of the instance; returns the shards
		// still held and the backend pid (the same on every renewal unless
		// a pooler hands out server connections per transaction).
		renew: q(`WITH m AS (
				INSERT INTO {schema}.relay_members (instance, relay_id, backend_pid, expires_at)
				VALUES ($1, $2, pg_backend_pid(), clock_timestamp() + make_interval(secs => $3))
				ON CONFLICT (instance) DO UPDATE SET expires_at = excluded.expires_at, backend_pid = excluded.backend_pid
			), l AS (
				UPDATE {schema}.relay_leases SET expires_at = clock_timestamp() + make_interval(secs => $3)
				WHERE owner = $1 AND expires_at > clock_timestamp() RETURNING shard
			)
			SELECT pg_backend_pid(), COALESCE((SELECT array_agg(shard) FROM l), '{}')`),
		live: q(`SELECT count(*) FROM {schema}.relay_members WHERE expires_at > clock_timestamp()`),
		// $1 shard count: shards without an unexpired lease.
		free: q(`SELECT s FROM generate_series(0, $1 - 1) s
			WHERE NOT EXISTS (SELECT 1 FROM {schema}.relay_leases l WHERE l.shard = s AND l.expires_at > clock_timestamp())`),
		// $1 shard, $2 instance, $3 lease seconds. Takes the shard if its
		// lease is missing or expired; concurrent takers of one shard
		// serialize on its row and only the first gets it.
		take: q(`INSERT INTO {schema}.relay_leases AS l (shard, owner, expires_at) VALUES ($1, $2, clock_timestamp() + make_interval(secs => $3))
			ON CONFLICT (shard) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at,
				acquired_at = clock_timestamp(), epoch = l.epoch + 1
			WHERE l.expires_at <= clock_timestamp() OR l.owner = excluded.owner
			RETURNING epoch`),
		release: q(`DELETE FROM {schema}.relay_leases WHERE shard = $1 AND owner = $2`),
		leave: q(`WITH l AS (DELETE FROM {schema}.relay_leases WHERE owner = $1)
			DELETE FROM {schema}.relay_members WHERE instance = $1`),
	}
}

// ownership is the state of the ownership loop.
type ownership struct {
	r     *Relay
	sql   leaseSQL
	conn  *pgxpool.Conn
	pid   uint32 // backend pid of conn, from its first renewal
	start int    // first shard this relay tries, to spread relays out
	// released are shards whose runner was stopped to rebalance; their
	// lease is deleted once the runner has ended.
	released map[int]bool
}

func (r *Relay) leaseTTL() time.Duration   { return leaseTTLIntervals * r.cfg.RebalanceInterval }
func (r *Relay) leaseValid() time.Duration { return leaseValidIntervals * r.cfg.RebalanceInterval }

// own keeps this relay's fair share of shards until ctx ends, then stops
// them, waits for their batches to settle and releases their leases. It
// returns an error only when the relay must not run (ErrSessionPooling).
func (r *Relay) own(ctx context.Context) error {
	o := &ownership{r: r, sql: newLeaseSQL(r.cfg.Schema), start: rand.IntN(r.shards), released: map[int]bool{}}
	defer o.shutdown()
	ticker := time.NewTicker(r.cfg.RebalanceInterval)
	defer ticker.Stop()
	for {
		if err := o.tick(ctx); err != nil {
			if errors.Is(err, ErrSessionPooling) {
				return err
			}
			if ctx.Err() == nil {
				r.log.Warn("shard ownership check failed; the shards keep relaying until their leases run out", "err", err)
			}
			o.dropConn()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		case <-r.exited:
			o.reap(ctx)
		}
	}
}

// tick renews the leases, settles ended runners and moves towards the fair
// share, ceil(shards / live relays): it releases shards above it and takes
// expired or free ones below it.
func (o *ownership) tick(ctx context.Context) error {
	r := o.r
	// A renewal that comes back late still counts from when it was sent:
	// the deadline can be as long as the lease's local validity.
	qctx, cancel := context.WithTimeout(ctx, r.leaseValid())
	defer cancel()
	if err := o.connect(qctx); err != nil {
		return err
	}
	held, deadline, err := o.renew(qctx)
	if err != nil {
		return err
	}
	// A released runner that ended since the renewal loses its lease now:
	// it was renewed, but is no longer held.
	for shard := range o.reap(qctx) {
		delete(held, shard)
	}

	var live int
	if err := o.conn.QueryRow(qctx, o.sql.live).Scan(&live); err != nil {
		return fmt.Errorf("count live relays: %w", err)
	}
	live = max(live, 1)
	share := (r.shards + live - 1) / live
	r.metrics.setLiveRelays(live)

	owned := r.ownedShards()
	// A lease still held without a runner: the runner stopped when its
	// local deadline passed before a late renewal came through, or after a
	// failure. Relay it again if the share allows, else let it go.
	for shard := range held {
		if r.runner(shard) != nil {
			continue
		}
		if len(owned) < share {
			delete(o.released, shard)
			r.startShard(shard, deadline)
			owned = append(owned, shard)
			r.log.Info("resumed shard", "shard", shard)
			continue
		}
		if _, err := o.conn.Exec(qctx, o.sql.release, shard, r.instance); err != nil {
			return fmt.Errorf("release shard %d: %w", shard, err)
		}
	}
	slices.Sort(owned)
	for len(owned) > share {
		shard := owned[len(owned)-1]
		owned = owned[:len(owned)-1]
		if runner := r.runner(shard); runner != nil {
			o.released[shard] = true
			runner.halt(stopReleased)
			r.log.Info("releasing shard to rebalance", "shard", shard, "live_relays", live)
		}
	}
	if len(owned) < share {
		rows, _ := o.conn.Query(qctx, o.sql.free, r.shards) // CollectRows reports its error
		free, err := pgx.CollectRows(rows, pgx.RowTo[int])
		if err != nil {
			return fmt.Errorf("list free shards: %w", err)
		}
		// Start from this relay's own offset, so relays starting together
		// try different shards first.
		slices.SortFunc(free, func(a, b int) int {
			return (a-o.start+r.shards)%r.shards - (b-o.start+r.shards)%r.shards
		})
		for _, shard := range free {
			if len(owned) >= share {
				break
			}
			if r.runner(shard) != nil {
				continue // still settling after a release or a lost lease
			}
			sent := time.Now()
			var epoch int64
			err := o.conn.QueryRow(qctx, o.sql.take, shard, r.instance, r.leaseTTL().Seconds()).Scan(&epoch)
			if errors.Is(err, pgx.ErrNoRows) {
				continue // another relay took it first
			}
			if err != nil {
				return fmt.Errorf("take shard %d: %w", shard, err)
			}
			delete(o.released, shard)
			r.startShard(shard, sent.Add(r.leaseValid()))
			owned = append(owned, shard)
			r.log.Info("took shard", "shard", shard, "lease_epoch", epoch, "live_relays", live)
		}
	}
	r.metrics.setOwnedShards(len(owned))
	return nil
}

// renew extends the member row and every lease this relay holds, and the
// local deadline of each shard it renewed. A running shard whose lease is
// gone (it expired and another relay took it) is stopped at once.
func (o *ownership) renew(ctx context.Context) (held map[int]bool, deadline time.Time, err error) {
	r := o.r
	sent := time.Now()
	var pid uint32
	var shards []int32
	if err := o.conn.QueryRow(ctx, o.sql.renew, r.instance, r.cfg.ID, r.leaseTTL().Seconds()).Scan(&pid, &shards); err != nil {
		return nil, time.Time{}, fmt.Errorf("renew shard leases: %w", err)
	}
	if o.pid != 0 && pid != o.pid {
		return nil, time.Time{}, fmt.Errorf("%w: the ownership connection's server process changed from %d to %d between two statements", ErrSessionPooling, o.pid, pid)
	}
	o.pid = pid
	held = make(map[int]bool, len(shards))
	for _, s := range shards {
		held[int(s)] = true
	}
	deadline = sent.Add(r.leaseValid())
	for shard, runner := range r.runners() {
		if held[shard] {
			runner.extend(deadline)
			continue
		}
		if !runner.stopping() || runner.reason() != stopLost {
			r.log.Warn("lost shard lease (it expired before this relay could renew it); stopping the shard", "shard", shard)
		}
		runner.halt(stopLost)
	}
	return held, deadline, nil
}

// reap forgets runners that ended and deletes the leases of those that
// were released, so another relay can take them at once. It returns the
// shards whose leases it released (or tried to: a lease it failed to
// delete expires by itself); the caller must not relay them on the
// strength of an earlier renewal.
func (o *ownership) reap(ctx context.Context) map[int]bool {
	r := o.r
	r.mu.Lock()
	var ended []*shardRunner
	for shard, runner := range r.running {
		if runner.ended() {
			ended = append(ended, runner)
			delete(r.running, shard)
		}
	}
	r.mu.Unlock()
	var released map[int]bool
	for _, runner := range ended {
		if !o.released[runner.shard] || o.conn == nil {
			continue
		}
		delete(o.released, runner.shard)
		if released == nil {
			released = map[int]bool{}
		}
		released[runner.shard] = true
		qctx, cancel := context.WithTimeout(ctx, r.cfg.RebalanceInterval)
		_, err := o.conn.Exec(qctx, o.sql.release, runner.shard, r.instance)
		cancel()
		if err != nil {
			r.log.Warn("release shard lease; it expires by itself", "shard", runner.shard, "err", err)
		}
	}
	return released
}

// shutdown stops every shard, renewing the leases while their batches
// settle, then deletes this relay's leases and member row.
func (o *ownership) shutdown() {
	r := o.r
	for _, runner := range r.runners() {
		runner.halt(stopShutdown)
	}
	ctx := context.Background()
	ticker := time.NewTicker(r.cfg.RebalanceInterval)
	defer ticker.Stop()
	giveUp := time.After(shutdownTimeout)
	for {
		o.reap(ctx)
		left := len(r.runners())
		if left == 0 {
			break
		}
		select {
		case <-giveUp:
			r.log.Error("shards did not stop in time; leaving them to their leases", "shards", left, "waited", shutdownTimeout)
			o.dropConn()
			return
		case <-r.exited:
		case <-ticker.C:
			qctx, cancel := context.WithTimeout(ctx, r.cfg.RebalanceInterval)
			if o.connect(qctx) == nil {
				if _, _, err := o.renew(qctx); err != nil {
					o.dropConn()
				}
			}
			cancel()
		}
	}
	r.metrics.setOwnedShards(0)
	qctx, cancel := context.WithTimeout(ctx, r.cfg.RebalanceInterval+time.Second)
	defer cancel()
	if o.connect(qctx) == nil {
		if _, err := o.conn.Exec(qctx, o.sql.leave, r.instance); err != nil {
			r.log.Warn("release shard leases on stop; they expire by themselves", "err", err)
		}
	}
	o.dropConn()
}

// connect acquires and prepares the ownership connection if there is none.
func (o *ownership) connect(ctx context.Context) error {
	if o.conn != nil {
		return nil
	}
	conn, err := o.r.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("acquire ownership connection: %w", err)
	}
	if err := o.r.prepareSession(ctx, conn.Conn(), true); err != nil {
		closeConn(conn)
		return err
	}
	o.conn, o.pid = conn, 0
	return nil
}

// dropConn closes the ownership connection: it may be broken, or hold
// session settings no other pool user should inherit.
func (o *ownership) dropConn() {
	if o.conn != nil {
		closeConn(o.conn)
		o.conn = nil
	}
}

// closeConn closes a pooled connection instead of returning it to the pool.
func closeConn(conn *pgxpool.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Conn().Close(ctx)
	conn.Release()
}

func (r *Relay) runner(shard int) *shardRunner {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.running[shard]
}
