package producer_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// pollTracer records the relay's poll statements (the query that asks
// whether each shard's next row is readable).
type pollTracer struct {
	mu    sync.Mutex
	texts map[string]int
	polls int
}

func (tr *pollTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.Contains(data.SQL, "AS readable FROM") {
		tr.mu.Lock()
		tr.texts[data.SQL]++
		tr.polls++
		tr.mu.Unlock()
	}
	return ctx
}

func (tr *pollTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (tr *pollTracer) reset() {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.texts, tr.polls = map[string]int{}, 0
}

func (tr *pollTracer) snapshot() (polls int, texts []string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for q := range tr.texts {
		texts = append(texts, q)
	}
	return tr.polls, texts
}

// topShare is the share of the polls that used the most used text.
func (tr *pollTracer) topShare() float64 {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	top := 0
	for _, n := range tr.texts {
		top = max(top, n)
	}
	return float64(top) / float64(max(tr.polls, 1))
}

// tracedRelayPool is a pool for a relay of env's shards whose statements
// tr sees.
func tracedRelayPool(t *testing.T, env pgtest.Env, tr *pollTracer) *pgxpool.Pool {
	cfg := env.Pool.Config().Copy()
	cfg.ConnConfig.Tracer = tr
	cfg.MaxConns = producer.PoolSizeFor(env.Shards)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// publishSteadily publishes one event every few milliseconds, the
// aggregates taken in turn from aggs, until the returned stop is called.
func publishSteadily(t *testing.T, env pgtest.Env, topic string, aggs []string) (stop func()) {
	p := newProducerWith(t, env, producer.Config{DefaultTopic: topic})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(4 * time.Millisecond) // ~250 events/s: a load, not a condition
		defer tick.Stop()
		for i := 0; ctx.Err() == nil; i++ {
			e, err := eventline.NewJSONEvent("order.updated", "order", aggs[i%len(aggs)], map[string]int{"seq": i})
			if err != nil {
				t.Error(err)
				return
			}
			if err := p.Publish(ctx, env.Pool, e); err != nil && ctx.Err() == nil {
				t.Error(err)
				return
			}
			select {
			case <-ctx.Done():
			case <-tick.C:
			}
		}
	}()
	return func() { cancel(); <-done }
}

// positionsMoved reports whether every shard in shards has a position past
// the one it had in from.
func positionsMoved(t *testing.T, env pgtest.Env, shards []int, from map[int]uint64) bool {
	for _, shard := range shards {
		tx, _, err := positionOf(context.Background(), env.Pool, env.Schema, shard)
		require.NoError(t, err)
		if tx <= from[shard] {
			return false
		}
	}
	return true
}

func positions(t *testing.T, env pgtest.Env) map[int]uint64 {
	out := map[int]uint64{}
	for shard := 0; shard < env.Shards; shard++ {
		tx, _, err := positionOf(context.Background(), env.Pool, env.Schema, shard)
		require.NoError(t, err)
		out[shard] = tx
	}
	return out
}

// TestRelayPollsBusyShardsWithOneStatement: under steady load on every
// shard, the relay polls with one statement text, so each connection keeps
// one prepared statement and PostgreSQL runs its generic plan instead of
// planning every poll. Before, the statement listed the shards lingering at
// that instant, which changed from poll to poll.
func TestRelayPollsBusyShardsWithOneStatement(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 4}, 4)
	tr := &pollTracer{texts: map[string]int{}}
	pool := tracedRelayPool(t, env, tr)
	_, stopRelay := relaytest.Start(t, pgtest.Env{Pool: pool, Schema: env.Schema, Shards: env.Shards}, producer.RelayConfig{Brokers: brokers})

	aggs := make([]string, 32)
	for i := range aggs {
		aggs[i] = "agg-" + strconv.Itoa(i)
	}
	all := []int{0, 1, 2, 3}
	for shard := range all {
		require.True(t, aggsCover(aggs, shard), "the aggregates must cover shard %d", shard)
	}
	require.Eventually(t, func() bool { return waitingShards(t, env) == 4 }, 15*time.Second, 10*time.Millisecond)
	start := positions(t, env)
	stop := publishSteadily(t, env, topic, aggs)
	defer stop()
	// Count from the moment every shard relays.
	require.Eventually(t, func() bool { return positionsMoved(t, env, all, start) }, 30*time.Second, 10*time.Millisecond)
	tr.reset()
	counted := time.Now()
	require.Eventually(t, func() bool { n, _ := tr.snapshot(); return n >= 500 }, 60*time.Second, 10*time.Millisecond)
	stop()
	polls, texts := tr.snapshot()
	t.Logf("%d polls in %s under ~250 events/s", polls, time.Since(counted).Round(time.Millisecond))
	// One text under steady load. A machine loaded enough to hold a shard
	// back for longer than busyWindow changes the list once in a while;
	// before the fix the text changed from poll to poll (15 texts in 501).
	share := tr.topShare()
	t.Logf("%d polls used %d statement texts, the most used one for %.1f%% of them", polls, len(texts), 100*share)
	require.GreaterOrEqual(t, share, 0.95, "%d polls used %d statement texts", polls, len(texts))

	// And PostgreSQL ran the generic plan of that statement for most polls.
	stopRelay()
	ctx := context.Background()
	var generic, custom int64
	for _, c := range pool.AcquireAllIdle(ctx) {
		var g, cu int64
		require.NoError(t, c.QueryRow(ctx, `SELECT coalesce(sum(generic_plans), 0)::bigint, coalesce(sum(custom_plans), 0)::bigint
			FROM pg_prepared_statements WHERE statement LIKE '%AS readable FROM%'`).Scan(&g, &cu))
		generic, custom = generic+g, custom+cu
		c.Release()
	}
	t.Logf("poll plans: %d generic, %d custom", generic, custom)
	require.Greater(t, generic, 4*custom, "most polls must run the prepared generic plan")
}

// aggsCover reports whether one of aggs maps to shard (of 4).
func aggsCover(aggs []string, shard int) bool {
	for _, a := range aggs {
		if outbox.ShardFor("order", a, 4) == shard {
			return true
		}
	}
	return false
}

// TestRelayPollsOnlyBusyShards: the poll statement covers the shards that
// relay rows; idle shards wait for notifications and cost the poll nothing.
func TestRelayPollsOnlyBusyShards(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 4}, 4)
	tr := &pollTracer{texts: map[string]int{}}
	relaytest.Start(t, pgtest.Env{Pool: tracedRelayPool(t, env, tr), Schema: env.Schema, Shards: env.Shards}, producer.RelayConfig{Brokers: brokers})
	// Every shard goes idle first: it asks producers to notify it.
	require.Eventually(t, func() bool { return waitingShards(t, env) == 4 }, 15*time.Second, 10*time.Millisecond)

	busy := outbox.ShardFor("order", "agg-0", 4)
	start := positions(t, env)
	stop := publishSteadily(t, env, topic, []string{"agg-0"})
	defer stop()
	require.Eventually(t, func() bool { return positionsMoved(t, env, []int{busy}, start) }, 30*time.Second, 10*time.Millisecond)
	tr.reset()
	require.Eventually(t, func() bool { n, _ := tr.snapshot(); return n >= 200 }, 60*time.Second, 10*time.Millisecond)
	stop()
	_, texts := tr.snapshot()
	for _, q := range texts {
		var polled []int
		for shard := 0; shard < env.Shards; shard++ {
			if strings.Contains(q, sqlident.Qualify(env.Schema, outbox.Table(shard))+" m") {
				polled = append(polled, shard)
			}
		}
		require.Equal(t, []int{busy}, polled, "a poll looked at idle shards:\n%s", q)
	}
}
