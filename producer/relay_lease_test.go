package producer_test

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// logRecorder is a slog handler that keeps every record at or above its
// level, and forwards them to the test log.
type logRecorder struct {
	t     testing.TB
	level slog.Level
	mu    *sync.Mutex
	recs  *[]slog.Record
	attrs []slog.Attr
}

func newLogRecorder(t testing.TB, level slog.Level) *logRecorder {
	return &logRecorder{t: t, level: level, mu: &sync.Mutex{}, recs: &[]slog.Record{}}
}

func (h *logRecorder) Enabled(_ context.Context, l slog.Level) bool { return l >= h.level }

func (h *logRecorder) Handle(_ context.Context, r slog.Record) error {
	r = r.Clone()
	r.AddAttrs(h.attrs...)
	h.mu.Lock()
	*h.recs = append(*h.recs, r)
	h.mu.Unlock()
	return nil
}

func (h *logRecorder) WithAttrs(as []slog.Attr) slog.Handler {
	c := *h
	c.attrs = append(append([]slog.Attr(nil), h.attrs...), as...)
	return &c
}

func (h *logRecorder) WithGroup(string) slog.Handler { return h }

// at returns the records at level l or above, formatted.
func (h *logRecorder) at(l slog.Level) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, r := range *h.recs {
		if r.Level < l {
			continue
		}
		s := r.Level.String() + " " + r.Message
		r.Attrs(func(a slog.Attr) bool { s += " " + a.String(); return true })
		out = append(out, s)
	}
	return out
}

// publisher publishes small transactions continuously until stopped, and
// remembers every event id it committed.
type publisher struct {
	mu     sync.Mutex
	ids    []string
	stop   chan struct{}
	done   chan struct{}
	errors atomic.Int64
}

func startPublisher(t *testing.T, env pgtest.Env, topic string, aggs int) *publisher {
	t.Helper()
	p := newProducerWith(t, env, producer.Config{DefaultTopic: topic})
	pub := &publisher{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(pub.done)
		for i := 0; ; i++ {
			select {
			case <-pub.stop:
				return
			default:
			}
			var events []eventline.Event
			for j := 0; j < 5; j++ {
				e, err := eventline.NewJSONEvent("order.updated", "order", "agg-"+strconv.Itoa(rand.IntN(aggs)), map[string]int{"i": i})
				if err != nil {
					panic(err)
				}
				e.ID = eventline.NewEventID()
				events = append(events, e)
			}
			if err := p.Publish(context.Background(), env.Pool, events...); err != nil {
				pub.errors.Add(1)
				continue
			}
			pub.mu.Lock()
			for _, e := range events {
				pub.ids = append(pub.ids, e.ID)
			}
			pub.mu.Unlock()
			time.Sleep(2 * time.Millisecond) // publishing pace
		}
	}()
	t.Cleanup(pub.finish)
	return pub
}

// finish stops publishing and returns every committed event id.
func (p *publisher) finish() {
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	<-p.done
}

func (p *publisher) committed() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.ids...)
}

// TestGracefulStopRecordsProgressWithoutErrors stops a relay again and
// again while producers keep publishing. A clean stop records the
// progress of the batch in flight: it logs no error, and no event is sent
// twice. Before the fix the progress write ran under the cancelled
// context and failed ("conn closed") in about half of the stops.
func TestGracefulStopRecordsProgressWithoutErrors(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2, MaxConns: 12}, 3)
	pub := startPublisher(t, env, topic, 50)

	logs := newLogRecorder(t, slog.LevelWarn)
	rounds := 15
	if testing.Short() {
		rounds = 6
	}
	for i := 0; i < rounds; i++ {
		_, stop := relaytest.Run(t, env.Pool, producer.RelayConfig{
			Schema: env.Schema, Brokers: brokers, Logger: slog.New(logs),
			PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond, BatchSize: 20,
		})
		time.Sleep(time.Duration(150+rand.IntN(250)) * time.Millisecond) // the relay's random lifetime: the fault schedule
		stop()
	}
	pub.finish()
	_, stop := relaytest.Run(t, env.Pool, producer.RelayConfig{Schema: env.Schema, Brokers: brokers, Logger: relaytest.Logger(t)})
	counts := relaytest.RequireAllDelivered(t, brokers, topic, pub.committed(), time.Minute)
	stop()
	require.Empty(t, logs.at(slog.LevelError), "a graceful stop must not log errors")
	twice := 0
	for _, n := range counts {
		if n > 1 {
			twice++
		}
	}
	require.Zero(t, twice, "a graceful stop records what Kafka acknowledged: nothing is sent twice")
}

// forceTakeover takes ownership away from whichever relay holds the shards
// while that relay keeps relaying, so another relay takes them over under
// its feet: the lease rows are deleted (and, for relays that own shards by
// session advisory locks, the sessions holding those locks are ended).
func forceTakeover(t *testing.T, env pgtest.Env) {
	t.Helper()
	ctx := context.Background()
	var leases bool
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, sqlident.Qualify(env.Schema, "relay_leases")).Scan(&leases))
	if leases {
		_, err := env.Pool.Exec(ctx, `DELETE FROM `+sqlident.Qualify(env.Schema, "relay_leases"))
		require.NoError(t, err)
		return
	}
	_, err := env.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND mode = 'ShareLock' AND objsubid = 2
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND classid::bigint = $1`, oldLockNamespace(env.Schema))
	require.NoError(t, err)
}

// oldLockNamespace is the advisory-lock namespace relays used for
// ownership before leases.
func oldLockNamespace(schema string) int64 {
	var h uint32 = 2166136261
	for _, c := range []byte("eventline.relay:" + schema) {
		h ^= uint32(c)
		h *= 16777619
	}
	return int64(h & 0x7fffffff)
}

// TestTakeoverWhileTheOwnerStillRuns: two relays, continuous publishing,
// and ownership taken away from the owners again and again while they are
// mid-batch, so the new owner starts a shard while the old one is still
// moving its position. Every event must arrive, and both relays must stop
// promptly. Before the fix the new owner's set-up failed with a
// serialization error (SQLSTATE 40001) in some rounds, and the shard stayed
// owned and unrelayed; stopping the relay then took 2m30s.
func TestTakeoverWhileTheOwnerStillRuns(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 4, MaxConns: 20}, 3)
	pub := startPublisher(t, env, topic, 100)

	cfg := producer.RelayConfig{
		Schema: env.Schema, Brokers: brokers, Logger: relaytest.Logger(t),
		PollInterval: 200 * time.Millisecond, RebalanceInterval: 100 * time.Millisecond, BatchSize: 10,
	}
	a, stopA := relaytest.Run(t, env.Pool, withID(cfg, "a"))
	b, stopB := relaytest.Run(t, env.Pool, withID(cfg, "b"))
	owned := func() int { return len(producer.OwnedShards(a)) + len(producer.OwnedShards(b)) }
	require.Eventually(t, func() bool { return owned() == env.Shards }, 10*time.Second, 10*time.Millisecond)
	rounds := 20
	if testing.Short() {
		rounds = 8
	}
	for i := 0; i < rounds; i++ {
		time.Sleep(time.Duration(50+rand.IntN(150)) * time.Millisecond) // random time between takeovers: the fault schedule
		forceTakeover(t, env)
		require.Eventually(t, func() bool {
			o, err := admin.ShardOwners(context.Background(), env.Pool, env.Schema)
			return err == nil && len(o) == env.Shards
		}, 10*time.Second, 10*time.Millisecond, "round %d: every shard owned again", i)
		waitRelayedPastNow(t, env, 10*time.Second, "round %d", i)
	}
	time.Sleep(300 * time.Millisecond) // the publisher keeps writing after the last takeover
	pub.finish()
	relaytest.RequireAllDelivered(t, brokers, topic, pub.committed(), 30*time.Second)
	st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
	require.NoError(t, err)
	for _, s := range st.Shards {
		require.Zero(t, s.Backlog, "shard %d still has a backlog: owned but not relayed", s.Shard)
	}
	for name, stop := range map[string]func() time.Duration{"a": stopA, "b": stopB} {
		took := stop()
		require.Less(t, took, 15*time.Second, "relay %s took %s to stop", name, took)
	}
}

// waitRelayedPastNow waits until every shard's position has passed the
// newest row committed when it was called: every shard is being relayed.
func waitRelayedPastNow(t *testing.T, env pgtest.Env, timeout time.Duration, msgAndArgs ...any) {
	t.Helper()
	ctx := context.Background()
	newest := make([][2]int64, env.Shards)
	for shard := range newest {
		var tx string
		err := env.Pool.QueryRow(ctx, `SELECT transaction_id::text, "offset" FROM `+sqlident.Qualify(env.Schema, outbox.Table(shard))+
			` ORDER BY transaction_id DESC, "offset" DESC LIMIT 1`).Scan(&tx, &newest[shard][1])
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		require.NoError(t, err)
		n, _ := strconv.ParseUint(tx, 10, 64)
		newest[shard][0] = int64(n)
	}
	require.Eventually(t, func() bool {
		for shard, want := range newest {
			tx, off, err := positionOf(ctx, env.Pool, env.Schema, shard)
			if err != nil || int64(tx) < want[0] || int64(tx) == want[0] && off < want[1] {
				return false
			}
		}
		return true
	}, timeout, 10*time.Millisecond, msgAndArgs...)
}

func withID(cfg producer.RelayConfig, id string) producer.RelayConfig {
	cfg.ID = id
	return cfg
}

// TestShardSetUpFailureIsRetried: a shard whose set-up fails (here the
// retry table is missing) is not left owned and idle: it is restarted with
// backoff, counted in eventline_relay_shard_restarts_total, and relays once
// the cause is gone.
func TestShardSetUpFailureIsRetried(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	ctx := context.Background()
	failures := sqlident.Qualify(env.Schema, "relay_failures")
	_, err := env.Pool.Exec(ctx, `ALTER TABLE `+failures+` RENAME TO relay_failures_away`)
	require.NoError(t, err)
	events := relaytest.PublishOrders(t, env, topic, 2, 10, 5)

	reg := prometheus.NewRegistry()
	metrics, err := producer.NewRelayMetrics(reg)
	require.NoError(t, err)
	logs := newLogRecorder(t, slog.LevelWarn)
	_, stop := relaytest.Run(t, env.Pool, producer.RelayConfig{Schema: env.Schema, Brokers: brokers, Metrics: metrics, Logger: slog.New(logs),
		PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond})
	require.Eventually(t, func() bool { return len(logs.at(slog.LevelError)) >= 2 }, 10*time.Second, 10*time.Millisecond,
		"the failed set-up is logged at every restart")
	require.Contains(t, logs.at(slog.LevelError)[0], "restarting")
	_, err = env.Pool.Exec(ctx, `ALTER TABLE `+sqlident.Qualify(env.Schema, "relay_failures_away")+` RENAME TO relay_failures`)
	require.NoError(t, err)
	relaytest.RequireAllDelivered(t, brokers, topic, relaytest.IDs(events), 30*time.Second)
	require.Less(t, stop(), 10*time.Second)
	require.GreaterOrEqual(t, metrictest.Sum(t, reg, "eventline_relay_shard_restarts_total"), 2.0)
}

// positionOf reads a shard's relay position.
func positionOf(ctx context.Context, pool *pgxpool.Pool, schema string, shard int) (txid uint64, offset int64, err error) {
	var tx string
	err = pool.QueryRow(ctx, `SELECT last_processed_transaction_id::text, offset_acked FROM `+
		sqlident.Qualify(schema, outbox.OffsetsTable(shard))+` WHERE consumer_group = $1`, outbox.RelayConsumerGroup).Scan(&tx, &offset)
	if err != nil {
		return 0, 0, err
	}
	txid, err = strconv.ParseUint(tx, 10, 64)
	return txid, offset, err
}

// watchPositions samples every shard's position until stop and fails the
// test if one ever moves backwards.
func watchPositions(t *testing.T, env pgtest.Env) (stop func()) {
	t.Helper()
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		last := make([][2]int64, env.Shards)
		for {
			select {
			case <-done:
				return
			case <-time.After(10 * time.Millisecond):
			}
			for shard := 0; shard < env.Shards; shard++ {
				tx, off, err := positionOf(context.Background(), env.Pool, env.Schema, shard)
				if err != nil {
					continue
				}
				cur := [2]int64{int64(tx), off}
				if cur[0] < last[shard][0] || cur[0] == last[shard][0] && cur[1] < last[shard][1] {
					t.Errorf("shard %d: position moved backwards from %v to %v", shard, last[shard], cur)
				}
				last[shard] = cur
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-stopped }) }
}

// waitOwnedBy waits until every shard's lease belongs to the relay with the
// given ID and returns how long that took.
func waitOwnedBy(t *testing.T, env pgtest.Env, relayID string, timeout time.Duration) time.Duration {
	t.Helper()
	began := time.Now()
	require.Eventually(t, func() bool {
		o, err := admin.ShardOwners(context.Background(), env.Pool, env.Schema)
		if err != nil || len(o) != env.Shards {
			return false
		}
		for _, owner := range o {
			if owner.Relay != relayID {
				return false
			}
		}
		return true
	}, timeout, 10*time.Millisecond, "every shard owned by %s", relayID)
	return time.Since(began)
}

// startProxy starts a fault proxy to PostgreSQL, closed when the test ends.
func startProxy(t *testing.T) *faultproxy.Proxy {
	t.Helper()
	proxy, err := faultproxy.Start(pgtest.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	return proxy
}

// proxiedPool opens a pool whose connections go through a fault proxy.
func proxiedPool(t *testing.T, p *faultproxy.Proxy, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URLVia(p.Addr()))
	require.NoError(t, err)
	cfg.MaxConns = maxConns
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// TestFrozenRelayIsTakenOverWithinTheBound freezes every connection of a
// relay that owns half the shards (the proxy stops forwarding without
// closing anything, as when its host vanishes or its VM pauses) and
// measures how long until the other relay owns and relays them: at most
// TakeoverBound(RebalanceInterval) plus the time to notice, where before
// the session advisory locks kept them owned until TCP gave up (hours).
// The frozen relay's Run still returns promptly when cancelled, and no
// position ever moves backwards.
func TestFrozenRelayIsTakenOverWithinTheBound(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 4, MaxConns: 12}, 3)
	proxy := startProxy(t)

	const interval = 200 * time.Millisecond
	cfg := producer.RelayConfig{Schema: env.Schema, Brokers: brokers, Logger: relaytest.Logger(t), PollInterval: time.Second, RebalanceInterval: interval, BatchSize: 20}
	_, stopA := relaytest.Run(t, proxiedPool(t, proxy, 10), withID(cfg, "frozen"))
	waitOwnedBy(t, env, "frozen", 10*time.Second)
	_, stopB := relaytest.Run(t, pgtest.Pool(t, 10), withID(cfg, "survivor"))
	require.Eventually(t, func() bool {
		o, err := admin.ShardOwners(context.Background(), env.Pool, env.Schema)
		if err != nil || len(o) != env.Shards {
			return false
		}
		n := 0
		for _, owner := range o {
			if owner.Relay == "survivor" {
				n++
			}
		}
		return n == env.Shards/2
	}, 10*time.Second, 10*time.Millisecond, "the relays share the shards")
	watch := watchPositions(t, env)
	defer watch()
	start := make([]uint64, env.Shards)
	for shard := range start {
		start[shard], _, _ = positionOf(context.Background(), env.Pool, env.Schema, shard)
	}
	pub := startPublisher(t, env, topic, 50)
	// Freeze only once both relays relay the publisher's stream (every
	// shard's position moved): the frozen relay has work in flight.
	require.Eventually(t, func() bool {
		for shard := range start {
			tx, _, err := positionOf(context.Background(), env.Pool, env.Schema, shard)
			if err != nil || tx <= start[shard] {
				return false
			}
		}
		return true
	}, time.Minute, 10*time.Millisecond, "both relays relay the stream")

	frozenAt := time.Now()
	proxy.Set(faultproxy.Freeze)
	owned := waitOwnedBy(t, env, "survivor", time.Minute)
	waitRelayedPastNow(t, env, 90*time.Second, "the survivor relays the frozen relay's shards")
	relayed := time.Since(frozenAt)
	bound := producer.TakeoverBound(interval)
	t.Logf("takeover of a frozen relay: owned after %s, relaying past the freeze after %s (bound %s, RebalanceInterval %s)",
		owned.Round(time.Millisecond), relayed.Round(time.Millisecond), bound, interval)
	require.Less(t, owned, bound+5*time.Second, "takeover took far longer than TakeoverBound")

	took := stopA()
	t.Logf("the frozen relay's Run returned %s after cancellation", took.Round(time.Millisecond))
	require.Less(t, took, 20*time.Second, "a relay with frozen connections must still stop")
	proxy.Set(faultproxy.Pass)
	pub.finish()
	relaytest.RequireAllDelivered(t, brokers, topic, pub.committed(), time.Minute)
	stopB()
	watch()
}

// TestRelayDetectsAPositionAheadAndRebaseRepairsIt: after a restore into a
// cluster with a lower transaction counter, new rows sort below the stored
// position and the relay would idle silently. It must say so (error log,
// eventline_relay_position_ahead, ReadStatus), and RebasePositions must get
// every event out: the old one not yet relayed first, then the new ones.
func TestRelayDetectsAPositionAheadAndRebaseRepairsIt(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	ctx := context.Background()
	cfg := producer.RelayConfig{Schema: env.Schema, Brokers: brokers, PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond}

	before := relaytest.PublishOrders(t, env, topic, 1, 3, 3)
	_, stop := relaytest.Run(t, env.Pool, withLogger(cfg, relaytest.Logger(t)))
	relaytest.RequireAllDelivered(t, brokers, topic, relaytest.IDs(before), 30*time.Second)
	stop()
	unsent := relaytest.PublishOrders(t, env, topic, 1, 1, 1) // committed, not relayed before the move
	relaytest.MoveToAHigherCounterCluster(t, env, 0)
	after := relaytest.PublishOrders(t, env, topic, 1, 2, 1) // written on the new cluster

	st, err := admin.ReadOutboxStatus(ctx, env.Pool, env.Schema)
	require.NoError(t, err)
	require.True(t, st.Shards[0].PositionAhead)
	reg := prometheus.NewRegistry()
	metrics, err := producer.NewRelayMetrics(reg)
	require.NoError(t, err)
	logs := newLogRecorder(t, slog.LevelError)
	_, stop = relaytest.Run(t, env.Pool, withLogger(withMetrics(cfg, metrics), slog.New(logs)))
	require.Eventually(t, func() bool { return len(logs.at(slog.LevelError)) > 0 }, 10*time.Second, 10*time.Millisecond)
	require.Contains(t, logs.at(slog.LevelError)[0], "eventline relay rebase-positions")
	require.Equal(t, 1.0, metrictest.Sum(t, reg, "eventline_relay_position_ahead"))
	stop()

	dry, err := admin.RebasePositions(ctx, env.Pool, env.Schema, true)
	require.NoError(t, err)
	require.EqualValues(t, 3, dry[0].Relayed)
	require.EqualValues(t, 1, dry[0].Pending)
	st, err = admin.ReadOutboxStatus(ctx, env.Pool, env.Schema)
	require.NoError(t, err)
	require.True(t, st.Shards[0].PositionAhead, "a dry run changes nothing")

	res, err := admin.RebasePositions(ctx, env.Pool, env.Schema, false)
	require.NoError(t, err)
	require.True(t, res[0].Ahead())
	require.EqualValues(t, 3, res[0].Relayed)
	require.EqualValues(t, 1, res[0].Pending)
	checks, err := admin.CheckPositions(ctx, env.Pool, env.Schema)
	require.NoError(t, err)
	require.False(t, checks[0].Ahead())

	_, stop = relaytest.Run(t, env.Pool, withLogger(cfg, relaytest.Logger(t)))
	want := append(relaytest.IDs(unsent), relaytest.IDs(after)...)
	recs := readTopic(t, brokers, topic, len(before)+len(want), 30*time.Second)
	counts := relaytest.Distinct(recs)
	for _, id := range want {
		require.Equal(t, 1, counts[id], "event %s relayed once after the re-base", id)
	}
	var order []string
	for _, r := range recs[len(before):] {
		order = append(order, r.EventID)
	}
	require.Equal(t, want, order, "the event that was waiting before the move goes first")
	stop()
	require.Empty(t, logs.at(slog.LevelError)[1:], "no more errors")
}

func withLogger(cfg producer.RelayConfig, l *slog.Logger) producer.RelayConfig {
	cfg.Logger = l
	return cfg
}

func withMetrics(cfg producer.RelayConfig, m *producer.RelayMetrics) producer.RelayConfig {
	cfg.Metrics = m
	return cfg
}
