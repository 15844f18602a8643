package e2e_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// faultRig is the fault test's pipeline: a producer and relay on the
// test's own pool, Kafka (kfake, or Apache Kafka in real-broker mode, see
// internal/kafkatest), and consumers whose pools reach PostgreSQL through a
// fault proxy.
type faultRig struct {
	t       *testing.T
	env     pgtest.Env
	cluster *kafkatest.Cluster
	brokers []string
	topic   string
	prod    *producer.Producer
	proxy   *faultproxy.Proxy
	applied string // qualified table: one row per handler run
	store   *store.Store
}

func newFaultRig(t *testing.T) *faultRig {
	t.Helper()
	return newFaultRigWith(t, 3, nil)
}

// newFaultRigWith is newFaultRig with a topic of the given partition count
// and configuration overrides.
func newFaultRigWith(t *testing.T, partitions int32, topicConfig map[string]string) *faultRig {
	t.Helper()
	env := pgtest.New(t, pgtest.Options{Shards: 1, MaxConns: 8})
	r := newRig(t, env, env.Pool, kafkatest.Start(t, kafkatest.Config{}), "orders", partitions, topicConfig)
	r.applied = sqlident.Qualify(env.Schema, "applied")
	_, err := env.Pool.Exec(context.Background(), `CREATE TABLE `+r.applied+` (
		seq bigserial PRIMARY KEY, grp text NOT NULL, event_id text NOT NULL, aggregate_id text NOT NULL,
		version bigint NOT NULL, late boolean NOT NULL)`)
	require.NoError(t, err)
	r.startProxy()
	r.store, err = store.New(env.Schema)
	require.NoError(t, err)
	return r
}

// newRig returns a rig on env and cluster, without proxy: a topic named
// after name (kafkatest.Topic: unique, the broker may be shared), created
// with partitions and topicConfig, and a producer of it on pool.
func newRig(t *testing.T, env pgtest.Env, pool *pgxpool.Pool, cluster *kafkatest.Cluster, name string, partitions int32, topicConfig map[string]string) *faultRig {
	t.Helper()
	r := &faultRig{t: t, env: env, cluster: cluster, brokers: cluster.Brokers, topic: kafkatest.Topic(t, name)}
	require.NoError(t, cluster.CreateTopicsWithConfig(context.Background(), partitions, topicConfig, r.topic))
	var err error
	r.prod, err = producer.New(context.Background(), pool, producer.Config{Schema: env.Schema, DefaultTopic: r.topic})
	require.NoError(t, err)
	return r
}

// startProxy starts the rig's fault proxy in front of the test database
// (proxiedPool), closed when the test ends.
func (r *faultRig) startProxy() {
	r.t.Helper()
	var err error
	r.proxy, err = faultproxy.Start(pgtest.Addr())
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _ = r.proxy.Close() })
}

// proxiedConnectTimeout bounds one connection attempt through the proxy.
const proxiedConnectTimeout = 500 * time.Millisecond

// proxiedPool is a consumer pool whose connections go through the proxy,
// configured as the docs recommend (bounded connection attempts, idle
// transactions ended by the server).
func (r *faultRig) proxiedPool() *pgxpool.Pool {
	r.t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(r.t, err)
	cfg.MaxConns = 6
	cfg.ConnConfig.ConnectTimeout = proxiedConnectTimeout
	cfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "2s"
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, r.proxy.Addr())
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(r.t, err)
	r.t.Cleanup(pool.Close)
	return pool
}

func (r *faultRig) runRelay() {
	r.t.Helper()
	rel, err := producer.NewRelay(context.Background(), r.env.Pool, producer.RelayConfig{
		Schema: r.env.Schema, Brokers: r.brokers,
		PollInterval: 100 * time.Millisecond, RebalanceInterval: 100 * time.Millisecond,
		Backoff: eventline.Backoff{Initial: 20 * time.Millisecond, Multiplier: 2.5, Max: 50 * time.Millisecond}, MaxAttempts: 3,
		Logger: testLogger(),
	})
	require.NoError(r.t, err)
	relaytest.Background(r.t, rel.Run)
}

// consumerConfig is the fault test's consumer configuration: a small,
// explicit retry schedule (so its budget is known), a short park timeout.
func (r *faultRig) consumerConfig(group string, late versioning.LatePolicy, metrics *middleware.Metrics) consumer.Config {
	sc := kafkaconf.Consumer("e2e-" + group)
	sc.Consumer.Group.Rebalance.Timeout = 5 * time.Second
	sc.Consumer.Group.Session.Timeout = 6 * time.Second
	sc.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	sc.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	sc.Consumer.Offsets.Initial = sarama.OffsetOldest
	return consumer.Config{
		Config: middleware.Config{
			Group:         group,
			Schema:        r.env.Schema,
			LatePolicy:    late,
			ParkTimeout:   time.Second,
			SweepInterval: 100 * time.Millisecond,
			MaxRetries:    3,
			TxTimeout:     5 * time.Second,
			Metrics:       metrics,
			Logger:        testLogger(),
			Retry:         eventline.Backoff{Initial: 50 * time.Millisecond, Multiplier: 2, Max: 200 * time.Millisecond, Jitter: 0.2},
			InfraBackoff:  eventline.Backoff{Max: 500 * time.Millisecond},
		},
		Brokers:         r.brokers,
		Topics:          []string{r.topic},
		ShutdownTimeout: 20 * time.Second,
		SaramaConfig:    sc,
	}
}

func testLogger() *slog.Logger {
	if os.Getenv("EVENTLINE_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// runConsumer starts a consumer on a proxied pool whose handler records
// each run, with whether the event was applied late.
func (r *faultRig) runConsumer(cfg consumer.Config) {
	r.t.Helper()
	c, err := consumer.New(r.proxiedPool(), cfg)
	require.NoError(r.t, err)
	group := cfg.Group
	require.NoError(r.t, c.Handle("order.updated", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+r.applied+` (grp, event_id, aggregate_id, version, late) VALUES ($1, $2, $3, $4, $5)`,
			group, e.ID, e.AggregateID, e.AggregateVersion, middleware.IsLate(ctx))
		return err
	}))
	relaytest.Background(r.t, c.Run)
}

// retryBudget is the longest a consumer configured with cfg can spend on
// one event before giving up on it as the handler's fault: 1+MaxRetries
// attempts, each failing at worst after a connection timeout, and the
// MaxRetries waits of the schedule (min(initial × multiplier^(n−1), max),
// stretched by the jitter).
func retryBudget(cfg consumer.Config, attempt time.Duration) time.Duration {
	var waits time.Duration
	w := float64(cfg.Retry.Initial)
	for n := 0; n < cfg.MaxRetries; n++ {
		waits += min(time.Duration(w), cfg.Retry.Max)
		w *= cfg.Retry.Multiplier
	}
	return time.Duration(float64(waits)*(1+cfg.Retry.Jitter)) + time.Duration(1+cfg.MaxRetries)*attempt
}

func (r *faultRig) publish(aggregateID string, n int) []eventline.Event {
	r.t.Helper()
	var evs []eventline.Event
	for i := 0; i < n; i++ {
		e, err := eventline.NewJSONEvent("order.updated", "order", aggregateID, map[string]string{"id": aggregateID})
		require.NoError(r.t, err)
		e.ID = eventline.NewEventID()
		evs = append(evs, e)
	}
	require.NoError(r.t, r.prod.Publish(context.Background(), r.env.Pool, evs...))
	return evs
}

type run struct {
	EventID string
	Version int64
	Late    bool
}

// runs returns a group's handler runs for an aggregate, in apply order.
func (r *faultRig) runs(group, aggregateID string) []run {
	r.t.Helper()
	rows, err := r.env.Pool.Query(context.Background(), `SELECT event_id, version, late FROM `+r.applied+` WHERE grp = $1 AND aggregate_id = $2 ORDER BY seq`, group, aggregateID)
	require.NoError(r.t, err)
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (run, error) {
		var x run
		return x, row.Scan(&x.EventID, &x.Version, &x.Late)
	})
	require.NoError(r.t, err)
	return out
}

func versions(rs []run) []int64 {
	out := make([]int64, len(rs))
	for i, x := range rs {
		out[i] = x.Version
	}
	return out
}

func (r *faultRig) count(query string, args ...any) int {
	r.t.Helper()
	return pgtest.Count(r.t, r.env.Pool, query, args...)
}

func (r *faultRig) table(name string) string { return sqlident.Qualify(r.env.Schema, name) }

// backlog is how many events the rig's outbox holds, not yet forwarded.
func (r *faultRig) backlog() int64 {
	st, err := admin.ReadOutboxStatus(context.Background(), r.env.Pool, r.env.Schema)
	require.NoError(r.t, err)
	return st.Backlog()
}

// relayDeadLetters lists the events the relay gave up on (held_events,
// kind relay_dead_letter).
func (r *faultRig) relayDeadLetters() []admin.HeldEvent {
	dls, err := admin.ListHeld(context.Background(), r.env.Pool, r.env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter})
	require.NoError(r.t, err)
	return dls
}

func (r *faultRig) waitRuns(group string, n int, what string) {
	r.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for r.count(`SELECT count(*) FROM `+r.applied+` WHERE grp = $1`, group) < n {
		if time.Now().After(deadline) {
			r.t.Fatalf("group %s: want %d handler runs (%s) within a minute; %s", group, n, what, r.describe(group))
		}
		time.Sleep(20 * time.Millisecond) // polling interval
	}
}

// describe says what became of a group's events, for failure messages.
func (r *faultRig) describe(group string) string {
	r.t.Helper()
	var b strings.Builder
	rows, err := r.env.Pool.Query(context.Background(), `SELECT aggregate_id, array_agg(version ORDER BY seq) FROM `+r.applied+` WHERE grp = $1 GROUP BY 1 ORDER BY 1`, group)
	require.NoError(r.t, err)
	for rows.Next() {
		var agg string
		var vs []int64
		require.NoError(r.t, rows.Scan(&agg, &vs))
		fmt.Fprintf(&b, "applied %s %v; ", agg, vs)
	}
	require.NoError(r.t, rows.Err())
	for _, table := range []string{"held_events", "parked_events", "skipped_versions"} {
		fmt.Fprintf(&b, "%s: %d; ", table, r.count(`SELECT count(*) FROM `+r.table(table)+` WHERE consumer_group = $1`, group))
	}
	rows, err = r.env.Pool.Query(context.Background(), `SELECT coalesce(string_agg(DISTINCT kind || ' ' || cause || ': ' || left(reason, 200), ' | '), '') FROM `+r.table("held_events")+` WHERE consumer_group = $1`, group)
	if err == nil {
		var errs string
		if rows.Next() && rows.Scan(&errs) == nil && errs != "" {
			fmt.Fprintf(&b, "dead-letter errors: %s", errs)
		}
		rows.Close()
	}
	return b.String()
}

// TestDatabaseOutageAndLateReplayLoseNothing runs producer ▸ relay ▸ Kafka
// ▸ two consumer groups whose database connections go through a fault
// proxy (issue 8, "Done means").
//
// Phase 1: the consumers' database refuses and resets connections for
// longer than their retry budget while events keep arriving; restored, it
// must see every event applied once, in per-aggregate order, with nothing
// dead-lettered, parked or skipped.
//
// Phase 2: an event whose Kafka produce failed for good lands in the
// relay's dead letters; its successors arrive, park, and the park timeout
// skips its version. Replayed then (the `eventline held replay` path, which
// first names the groups that skipped it), it arrives late: the group with
// the default late policy holds it for the operator (listed; applied late
// once the operator asks, `eventline held replay`), the group with
// ApplyLate applies it at once with middleware.IsLate. Never dropped.
func TestDatabaseOutageAndLateReplayLoseNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r := newFaultRig(t)
	hold, apply := kafkatest.Topic(t, "hold"), kafkatest.Topic(t, "apply") // unique: the broker may be shared
	groups := []string{hold, apply}
	regs := map[string]*prometheus.Registry{}
	var cfg consumer.Config
	r.runRelay()
	for _, g := range groups {
		regs[g] = prometheus.NewRegistry()
		metrics, err := middleware.NewMetrics(regs[g])
		require.NoError(t, err)
		policy := versioning.HoldLate
		if g == apply {
			policy = versioning.ApplyLate
		}
		cfg = r.consumerConfig(g, policy, metrics)
		r.runConsumer(cfg)
	}

	// Phase 1: a database outage longer than the retry budget.
	aggs := []string{"a", "b", "c", "d", "e", "f"}
	const perAgg = 5
	for _, a := range aggs {
		r.publish(a, 1)
	}
	for _, g := range groups {
		r.waitRuns(g, len(aggs), "version 1 before the outage")
	}

	r.proxy.Set(faultproxy.Refuse)
	r.proxy.Drop()
	outageStart := time.Now()
	for _, a := range aggs {
		r.publish(a, perAgg-1)
	}
	require.Eventually(t, func() bool { return r.backlog() == 0 }, time.Minute, 20*time.Millisecond, "the relay forwards the events published during the outage")
	budget := retryBudget(cfg, proxiedConnectTimeout)
	// The outage lasts until the consumers have tried to reconnect more
	// often than two events' whole budgets allow and for twice the budget's
	// time, and until both groups say they wait for the database.
	sawWaiting := map[string]bool{}
	require.Eventually(t, func() bool {
		for _, g := range groups {
			if metrictest.Sum(t, regs[g], "eventline_consumer_waiting_on_database") > 0 {
				sawWaiting[g] = true
			}
		}
		return r.proxy.Refused() > int64(2*len(groups)*(1+cfg.MaxRetries)) && time.Since(outageStart) > 2*budget &&
			(len(sawWaiting) == len(groups) || time.Since(outageStart) > 4*budget)
	}, time.Minute, 20*time.Millisecond, "the outage outlasts the retry budget (%s)", budget)
	outage := time.Since(outageStart)
	require.Greater(t, outage, budget, "the outage must outlast the retry budget")
	require.Equal(t, len(aggs)*len(groups), r.count(`SELECT count(*) FROM `+r.applied), "nothing applied during the outage")
	r.proxy.Set(faultproxy.Pass)
	t.Logf("outage %s, %d reconnects refused; retry budget %s (%d retries, %s…%s, jitter %g, connect timeout %s)",
		outage.Round(time.Millisecond), r.proxy.Refused(), budget, cfg.MaxRetries, cfg.Retry.Initial, cfg.Retry.Max, cfg.Retry.Jitter, proxiedConnectTimeout)

	for _, g := range groups {
		r.waitRuns(g, len(aggs)*perAgg, "every event after the outage")
	}
	want := []int64{1, 2, 3, 4, 5}
	for _, g := range groups {
		for _, a := range aggs {
			rs := r.runs(g, a)
			require.Equal(t, want, versions(rs), "group %s, aggregate %s: each version applied once, in order", g, a)
			for _, x := range rs {
				require.False(t, x.Late, "group %s: %s v%d applied late", g, a, x.Version)
			}
		}
		require.Zero(t, metrictest.Sum(t, regs[g], "eventline_consumer_events_dead_lettered_total"), "group %s dead-lettered", g)
	}
	for _, table := range []string{"parked_events", "skipped_versions"} {
		require.Zero(t, r.count(`SELECT count(*) FROM `+r.table(table)), "phase 1: %s must be empty", table)
	}
	require.Zero(t, r.count(`SELECT count(*) FROM `+r.table("held_events")+` WHERE kind <> 'relay_dead_letter'`), "phase 1: no consumer dead letter or late event held")
	for _, g := range groups {
		require.True(t, sawWaiting[g], "group %s never reported that it waits for the database", g)
		require.Eventually(t, func() bool { return metrictest.Sum(t, regs[g], "eventline_consumer_waiting_on_database") == 0 },
			time.Minute, 20*time.Millisecond, "group %s reports the outage over", g)
	}

	// Phase 2: a relay dead letter replayed after the gap was skipped.
	r.publish("L", 1)
	for _, g := range groups {
		require.Eventually(t, func() bool { return len(r.runs(g, "L")) == 1 }, time.Minute, 20*time.Millisecond, "group %s applies L v1", g)
	}
	// Kafka refuses L v2 for good: the topic's max.message.bytes is set
	// below any record, and the relay, idle, sends L v2 alone. Restored
	// once it is dead-lettered.
	require.NoError(t, r.cluster.SetTopicConfig(r.topic, "max.message.bytes", "16"))
	v2 := r.publish("L", 1)[0]
	var dls []admin.HeldEvent
	require.Eventually(t, func() bool {
		dls = r.relayDeadLetters()
		return len(dls) == 1
	}, time.Minute, 20*time.Millisecond, "the relay dead-letters L v2")
	require.Equal(t, v2.ID, dls[0].EventID)
	require.EqualValues(t, 2, dls[0].AggregateVersion)
	require.NoError(t, r.cluster.SetTopicConfig(r.topic, "max.message.bytes", "1048588")) // Kafka's default

	r.publish("L", 2) // v3, v4: park behind the missing v2, then the park timeout skips it
	for _, g := range groups {
		require.Eventually(t, func() bool { return slices.Equal(versions(r.runs(g, "L")), []int64{1, 3, 4}) },
			time.Minute, 20*time.Millisecond, "group %s skips v2 after the park timeout and applies v3, v4", g)
		sk, err := r.store.ListSkipped(ctx, r.env.Pool, store.SkippedFilter{Group: g, AggregateType: "order", AggregateID: "L"})
		require.NoError(t, err)
		require.Len(t, sk, 1)
		require.Equal(t, [2]int64{2, 2}, [2]int64{sk[0].From, sk[0].To}, "group %s", g)
	}
	// What `eventline held replay` warns about.
	res, err := admin.ReplayHeld(ctx, r.env.Pool, r.env.Schema, admin.HeldFilter{IDs: []int64{dls[0].ID}})
	require.NoError(t, err)
	require.Equal(t, []int64{dls[0].ID}, res.Enqueued)
	require.Len(t, res.ArrivesLate, 1)
	skippedBy := res.ArrivesLate[0].Groups
	slices.Sort(skippedBy)
	require.Equal(t, []string{apply, hold}, skippedBy)

	// ApplyLate: applied at once, told it is late.
	require.Eventually(t, func() bool { return len(r.runs(apply, "L")) == 4 }, time.Minute, 20*time.Millisecond, "group apply applies the replayed v2")
	require.Equal(t, []run{{EventID: v2.ID, Version: 2, Late: true}}, r.runs(apply, "L")[3:], "group apply: v2 applied late")

	// HoldLate (the default): held for the operator, listed, not applied…
	var held []admin.HeldEvent
	require.Eventually(t, func() bool {
		held, err = admin.ListHeld(ctx, r.env.Pool, r.env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: hold})
		require.NoError(t, err)
		return len(held) == 1
	}, time.Minute, 20*time.Millisecond, "group hold holds the replayed v2 as late")
	require.Equal(t, v2.ID, held[0].EventID)
	require.Equal(t, "arrived_late", held[0].Cause)
	require.Equal(t, []int64{1, 3, 4}, versions(r.runs(hold, "L")), "group hold: a held event is not applied")
	// …until the operator asks (`eventline held replay <id>`).
	res, err = admin.ReplayHeld(ctx, r.env.Pool, r.env.Schema, admin.HeldFilter{IDs: []int64{held[0].ID}})
	require.NoError(t, err)
	require.Equal(t, []int64{held[0].ID}, res.Requested)
	require.Eventually(t, func() bool { return len(r.runs(hold, "L")) == 4 }, time.Minute, 20*time.Millisecond, "group hold applies v2 on request")
	require.Equal(t, []run{{EventID: v2.ID, Version: 2, Late: true}}, r.runs(hold, "L")[3:], "group hold: v2 applied late")
	require.Eventually(t, func() bool {
		held, err = admin.ListHeld(ctx, r.env.Pool, r.env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: hold})
		require.NoError(t, err)
		return len(held) == 0
	}, time.Minute, 20*time.Millisecond, "an applied late event is replayed, no longer open")

	// Nothing dead-lettered by a consumer, nothing run twice, the relay's
	// dead letter marked replayed.
	require.Zero(t, r.count(`SELECT count(*) FROM `+r.table("held_events")+` WHERE kind = 'dead_letter'`), "consumer dead letters")
	require.Zero(t, r.count(`SELECT count(*) FROM (SELECT grp, event_id FROM `+r.applied+` GROUP BY 1, 2 HAVING count(*) > 1) d`), "an event ran twice")
	all, err := admin.ListHeld(ctx, r.env.Pool, r.env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter, Statuses: []admin.HeldStatus{admin.StatusReplayed}})
	require.NoError(t, err)
	require.Len(t, all, 1)
	require.NotNil(t, all[0].ReplayedAt)
	for _, g := range groups {
		require.Zero(t, metrictest.Sum(t, regs[g], "eventline_consumer_events_dead_lettered_total"), "group %s dead-lettered", g)
		require.Equal(t, len(aggs)*perAgg+4, r.count(`SELECT count(*) FROM `+r.applied+` WHERE grp = $1`, g), fmt.Sprintf("group %s: every event applied once", g))
	}
}
