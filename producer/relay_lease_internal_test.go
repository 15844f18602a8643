package producer

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
)

// TestTickNeverRelaysAShardWhoseLeaseReapReleased: a shard released to
// rebalance keeps its lease until its runner ends; the ownership loop then
// deletes the lease (reap). When the runner ends between a tick's renewal
// and its reap, the renewal still lists the shard as held. Before the fix
// the tick then restarted the shard on the strength of that renewal,
// after reap had deleted its lease: the shard ran without a lease (another
// relay could take it meanwhile) until the next renewal stopped it. Every
// shard a relay runs must have a lease row naming it.
func TestTickNeverRelaysAShardWhoseLeaseReapReleased(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	r, err := NewRelay(ctx, env.Pool, RelayConfig{Schema: env.Schema, Brokers: []string{"127.0.0.1:1"},
		RebalanceInterval: time.Second, PollInterval: time.Second, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	o := &ownership{r: r, sql: newLeaseSQL(env.Schema), released: map[int]bool{}}
	t.Cleanup(o.shutdown)
	require.NoError(t, o.connect(ctx))
	var epoch int64
	require.NoError(t, o.conn.QueryRow(ctx, o.sql.take, 0, r.instance, r.leaseTTL().Seconds()).Scan(&epoch))

	// Shard 0 was released to rebalance, and its runner has just ended,
	// after the renewal the next tick makes: reap will delete its lease.
	ended := &shardRunner{relay: r, shard: 0, done: make(chan struct{}), leaseTimer: time.AfterFunc(time.Hour, func() {})}
	ended.soft, ended.cancelSoft = context.WithCancel(ctx)
	ended.hard, ended.cancelHard = context.WithCancel(ctx)
	ended.halt(stopReleased)
	ended.cancelHard()
	close(ended.done)
	r.mu.Lock()
	r.running[0] = ended
	r.mu.Unlock()
	o.released[0] = true

	// The share (one live relay, one shard) wants the shard back.
	require.NoError(t, o.tick(ctx))
	require.Equal(t, []int{0}, r.ownedShards(), "the shard is relayed again")
	for _, shard := range r.ownedShards() {
		var n int
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM `+sqlident.Qualify(env.Schema, "relay_leases")+
			` WHERE shard = $1 AND owner = $2 AND expires_at > clock_timestamp()`, shard, r.instance).Scan(&n))
		require.Equal(t, 1, n, "shard %d runs without a lease", shard)
	}
}
