package e2e_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// Kafka outage of TestKafkaOutageLosesNothing: the broker refuses every
// connection (open ones dropped) for kafkaRefuseFor, then, after the
// pipeline caught up, stops answering on every connection, open and new,
// for kafkaFreezeFor. Both outlive the clients' retry budgets: Sarama's
// producer retries (5 × 100 ms), its metadata retries (3 × 250 ms), the
// relay's attempts (3, 20 ms and 50 ms apart), the consumer group's session
// timeout (6 s) and, for the freeze, the clients' network timeouts
// (kafkaNetTimeout for the consumers; for the relay kafkaRelayNetTimeout
// with one producer retry and one metadata retry: by default its Sarama
// producer's own retries, each refreshing metadata, would outlast the
// freeze, and the relay would not hear of it).
const (
	kafkaRefuseFor       = 20 * time.Second
	kafkaFreezeFor       = 15 * time.Second
	kafkaNetTimeout      = 5 * time.Second
	kafkaRelayNetTimeout = time.Second
)

// TestKafkaOutageLosesNothing runs producer ▸ relay ▸ Kafka ▸ two
// consumer groups (the laned subscriber, watermill-kafka's), all in this
// process, while events are published continuously (PublishTx), and takes
// the whole Kafka broker away twice mid-run: first it refuses and resets
// every connection, then it stops answering without closing any. Neither
// the relay nor a consumer is restarted: each must notice Kafka is back by
// itself and catch up. In the end every committed event is applied
// once, in per-aggregate order, with nothing dead-lettered (relay or
// consumer), parked, skipped or held late, and internal/verify reports
// nothing.
func TestKafkaOutageLosesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("the Kafka outages last about 35 s")
	}
	t.Parallel()
	seed, _ := chaosSeed(t)
	ctx := context.Background()

	env := pgtest.New(t, pgtest.Options{Shards: 2, MaxConns: 8})
	r := &faultRig{t: t, env: env}
	var faults *kafkatest.Faults
	r.cluster, r.brokers, faults = kafkatest.FakeWithFaults(t)
	r.topic = kafkatest.Topic(t, "outage")
	kafkatest.CreateTopic(t, r.brokers, r.topic, 3)
	var err error
	r.prod, err = producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: r.topic})
	require.NoError(t, err)
	r.proxy, err = faultproxy.Start(pgtest.Addr()) // stays in Pass: only Kafka fails here
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.proxy.Close() })

	// The relay: three attempts per event, so an outage counted as
	// attempts would dead-letter at once; short network timeouts and
	// Sarama retries so the freeze outlives them.
	sc := kafkaconf.Producer("e2e-outage-relay")
	shortNetTimeouts(sc, kafkaRelayNetTimeout)
	sc.Producer.Retry.Max, sc.Metadata.Retry.Max = 1, 1
	relayReg := prometheus.NewRegistry()
	relayMetrics, err := producer.NewRelayMetrics(relayReg)
	require.NoError(t, err)
	relayRetries := func() float64 { return metrictest.Sum(t, relayReg, "eventline_relay_retries_total") }
	rel, err := producer.NewRelay(ctx, env.Pool, producer.RelayConfig{
		Schema: env.Schema, Brokers: r.brokers, SaramaConfig: sc, Metrics: relayMetrics,
		PollInterval: 100 * time.Millisecond, RebalanceInterval: 100 * time.Millisecond,
		Backoff: eventline.Backoff{Initial: 20 * time.Millisecond, Multiplier: 2.5, Max: 50 * time.Millisecond}, MaxAttempts: 3,
		Logger: testLogger(),
	})
	require.NoError(t, err)
	stopRelay := runUntilStopped(t, rel.Run)

	// Two consumer groups, one per subscriber kind: the laned, batching
	// one (the default) and watermill-kafka's (Lanes and BatchSize 1).
	// No park timeout (nothing may be skipped), short network timeouts.
	type group struct {
		name, effects string
		reg           *prometheus.Registry
		stop          func()
	}
	groups := []*group{{name: "laned"}, {name: "watermill"}}
	for _, g := range groups {
		g.effects = r.table("outage_effects_" + g.name)
		_, err = env.Pool.Exec(ctx, `CREATE TABLE `+g.effects+` (seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL)`)
		require.NoError(t, err)
		g.reg = prometheus.NewRegistry()
		metrics, err := middleware.NewMetrics(g.reg)
		require.NoError(t, err)
		cfg := r.consumerConfig(g.name, versioning.HoldLate, metrics)
		cfg.ParkTimeout = 0
		if g.name == "watermill" {
			cfg.Lanes, cfg.BatchSize = 1, 1
		}
		shortNetTimeouts(cfg.SaramaConfig, kafkaNetTimeout)
		c, err := consumer.New(r.proxiedPool(), cfg)
		require.NoError(t, err)
		effects := g.effects
		require.NoError(t, c.Handle("order.updated", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+effects+` (event_id, aggregate_id, version) VALUES ($1, $2, $3)`, e.ID, e.AggregateID, e.AggregateVersion)
			return err
		}))
		g.stop = runUntilStopped(t, c.Run)
	}

	// The producer: PublishTx in its own transaction, without pause;
	// committed counts the events whose transaction committed.
	var committed atomic.Int64
	stopPublishing := publishRandomly(seed, func(evs []eventline.Event) bool {
		err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error { return r.prod.PublishTx(ctx, tx, evs...) })
		if err != nil {
			t.Errorf("publish: %v", err)
			return false
		}
		committed.Add(int64(len(evs)))
		return true
	})
	stopPublishing = sync.OnceFunc(stopPublishing)
	t.Cleanup(stopPublishing) // if the test fails before it stops publishing
	// applied is the fewest events a group has applied.
	applied := func() int {
		n := -1
		for _, g := range groups {
			if m := r.count(`SELECT count(*) FROM ` + g.effects); n < 0 || m < n {
				n = m
			}
		}
		return n
	}
	// caughtUp waits until every group applied every event committed so
	// far and returns how long that took.
	caughtUp := func(what string) time.Duration {
		t.Helper()
		start, want := time.Now(), int(committed.Load())
		require.Eventually(t, func() bool { return applied() >= want }, time.Minute, 20*time.Millisecond,
			"seed %d: %s: %d events committed, applied: %d", seed, what, want, applied())
		return time.Since(start)
	}
	// Before the outages: the pipeline runs (the consumer has joined its
	// group and applies events).
	require.Eventually(t, func() bool { return committed.Load() >= 100 }, time.Minute, 20*time.Millisecond)
	caughtUp("before the outages")

	// Outage 1: every connection refused, the open ones reset. The relay
	// must feel it (its Sarama producer gives up, the relay retries).
	retries := relayRetries()
	faults.Set(faultproxy.Refuse)
	faults.Drop()
	time.Sleep(kafkaRefuseFor) // the outage's duration
	refused := faults.Refused()
	faults.Set(faultproxy.Pass)
	refuseRecovery := caughtUp("after Kafka refused connections")
	refuseRetries := relayRetries() - retries
	t.Logf("refuse %s: clients reconnected %d times, the relay retried %g times; %d events committed, caught up %s after Kafka came back",
		kafkaRefuseFor, refused, refuseRetries, committed.Load(), refuseRecovery.Round(time.Millisecond))
	require.Positive(t, refused, "the clients tried to reconnect during the outage")
	require.Positive(t, refuseRetries, "the relay's publishes failed during the outage")

	// Outage 2: the broker stops answering, connections stay open.
	retries = relayRetries()
	conns := faults.Conns()
	faults.Set(faultproxy.Freeze)
	time.Sleep(kafkaFreezeFor) // the outage's duration
	faults.Set(faultproxy.Pass)
	freezeRecovery := caughtUp("after Kafka stopped answering")
	freezeRetries := relayRetries() - retries
	t.Logf("freeze %s of %d open connections: the relay retried %g times; %d events committed, caught up %s after Kafka answered again",
		kafkaFreezeFor, conns, freezeRetries, committed.Load(), freezeRecovery.Round(time.Millisecond))
	require.Positive(t, conns, "clients were connected when Kafka froze")
	// Whether the relay's publishes failed during the freeze (freezeRetries)
	// depends on where its batches were when Kafka froze: once in 10 runs
	// under load none did. Only the catching up above is required.

	stopPublishing()
	total := int(committed.Load())
	p := &pipeline{t: t, env: env, brokers: r.brokers, topic: r.topic}
	for _, g := range groups {
		r.waitAllApplied(ctx, seed, g.name, g.effects, total)
		p.waitConsumed(g.name)
	}
	// Stopped only now: had one ended by itself, runUntilStopped would have
	// failed the test.
	for _, g := range groups {
		g.stop()
	}
	stopRelay()

	dls, err := admin.ListHeld(ctx, env.Pool, env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter,
		Statuses: []admin.HeldStatus{admin.StatusHeld, admin.StatusReplayed, admin.StatusDiscarded}})
	require.NoError(t, err)
	require.Empty(t, dls, "the relay dead-lettered events")
	for _, table := range []string{dedup.DeadLetterTable, "parked_events", "skipped_versions", "late_events"} {
		require.Zero(t, r.count(`SELECT count(*) FROM `+r.table(table)), "%s must be empty", table)
	}
	for _, g := range groups {
		r.requireAppliedOnceInOrder(seed, g.effects)
		require.Zero(t, metrictest.Sum(t, g.reg, "eventline_consumer_events_dead_lettered_total"), "group %s", g.name)
		r.requireVerifyClean(ctx, seed, g.name, g.effects, total)
	}
	t.Logf("%d events, all applied once in order by both groups", total)
}

// shortNetTimeouts sets a Sarama client's network timeouts to d.
func shortNetTimeouts(sc *sarama.Config, d time.Duration) {
	sc.Net.DialTimeout = d
	sc.Net.ReadTimeout = d
	sc.Net.WriteTimeout = d
}
