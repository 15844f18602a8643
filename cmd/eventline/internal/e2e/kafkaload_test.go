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
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// kafkaLoad is the rig of the tests that take Kafka away under load
// (TestKafkaOutageLosesNothing and the broker_*_test.go tests): producer
// ▸ relay ▸ Kafka ▸ two consumer groups (lanes and batches, the default,
// and one lane of batches of one: Lanes and BatchSize 1, the setting that
// once used watermill-kafka's subscriber),
// all in this process, while events are published continuously
// (PublishTx). Neither the relay nor a consumer is restarted: each must
// notice Kafka is back by itself. finish checks that every committed event
// was applied once, in per-aggregate order, by both groups, with nothing
// dead-lettered (relay or consumer), parked, skipped or held late, and that
// admin/verify reports nothing.
type kafkaLoad struct {
	*faultRig
	seed      uint64
	committed atomic.Int64
	groups    []*loadGroup
	relayReg  *prometheus.Registry

	stopRelay      func() time.Duration
	stopPublishing func()
}

type loadGroup struct {
	name, group, effects string // group: the consumer group, name made unique
	reg                  *prometheus.Registry
	stop                 func() time.Duration
}

// loadTimeouts are the clients' Kafka network timeouts: short, so a
// broker that stops answering is noticed within the fault's duration.
type loadTimeouts struct {
	// consumer is the consumers' dial, read and write timeout.
	consumer time.Duration
	// relay is the relay's; its Sarama producer and metadata retries are
	// one each, so that it hears of an outage: by default its producer's
	// own retries, each refreshing metadata, could outlast it.
	relay time.Duration
	// refresh, when set, is every client's Metadata.RefreshFrequency
	// (Sarama's default: 10 minutes), how soon they see a topic change.
	refresh time.Duration
}

// startKafkaLoad starts the rig on cluster (a topic of 3 partitions) and
// waits until both groups applied the first 100 events.
func startKafkaLoad(t *testing.T, cluster *kafkatest.Cluster, name string, timeouts loadTimeouts) *kafkaLoad {
	t.Helper()
	seed, _ := chaosSeed(t)
	ctx := context.Background()
	env := pgtest.New(t, pgtest.Options{Shards: 2, MaxConns: 8})
	r := newRig(t, env, env.Pool, cluster, name, 3, nil)
	r.startProxy() // stays in Pass: only Kafka fails here
	l := &kafkaLoad{faultRig: r, seed: seed}

	// The relay: three attempts per event, so an outage counted as
	// attempts would dead-letter at once.
	sc := kafkaconf.Producer("e2e-" + name + "-relay")
	shortNetTimeouts(sc, timeouts.relay)
	sc.Producer.Retry.Max, sc.Metadata.Retry.Max = 1, 1
	if timeouts.refresh > 0 {
		sc.Metadata.RefreshFrequency = timeouts.refresh
	}
	l.relayReg = prometheus.NewRegistry()
	relayMetrics, err := producer.NewRelayMetrics(l.relayReg)
	require.NoError(t, err)
	rel, err := producer.NewRelay(ctx, env.Pool, producer.RelayConfig{
		Schema: env.Schema, Brokers: r.brokers, SaramaConfig: sc, Metrics: relayMetrics,
		PollInterval: 100 * time.Millisecond, RebalanceInterval: 100 * time.Millisecond,
		Backoff: eventline.Backoff{Initial: 20 * time.Millisecond, Multiplier: 2.5, Max: 50 * time.Millisecond}, MaxAttempts: 3,
		Logger: testLogger(),
	})
	require.NoError(t, err)
	l.stopRelay = relaytest.Background(t, rel.Run)

	// No park timeout (nothing may be skipped), short network timeouts.
	l.groups = []*loadGroup{{name: "laned"}, {name: "watermill"}}
	for _, g := range l.groups {
		g.group = kafkatest.Topic(t, g.name) // unique: the broker may be shared
		g.effects = r.table(name + "_effects_" + g.name)
		_, err = env.Pool.Exec(ctx, `CREATE TABLE `+g.effects+` (seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL)`)
		require.NoError(t, err)
		g.reg = prometheus.NewRegistry()
		metrics, err := middleware.NewMetrics(g.reg)
		require.NoError(t, err)
		cfg := r.consumerConfig(g.group, versioning.HoldLate, metrics)
		cfg.ParkTimeout = 0
		if g.name == "watermill" {
			cfg.Lanes, cfg.BatchSize = 1, 1
		}
		shortNetTimeouts(cfg.SaramaConfig, timeouts.consumer)
		if timeouts.refresh > 0 {
			cfg.SaramaConfig.Metadata.RefreshFrequency = timeouts.refresh
		}
		c, err := consumer.New(r.proxiedPool(), cfg)
		require.NoError(t, err)
		effects := g.effects
		require.NoError(t, c.Handle("order.updated", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+effects+` (event_id, aggregate_id, version) VALUES ($1, $2, $3)`, e.ID, e.AggregateID, e.AggregateVersion)
			return err
		}))
		g.stop = relaytest.Background(t, c.Run)
	}

	// The producer: PublishTx in its own transaction, without pause.
	stop := publishRandomly(seed, func(evs []eventline.Event) bool {
		err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error { return r.prod.PublishTx(ctx, tx, evs...) })
		if err != nil {
			t.Errorf("publish: %v", err)
			return false
		}
		l.committed.Add(int64(len(evs)))
		return true
	})
	l.stopPublishing = sync.OnceFunc(stop)
	t.Cleanup(l.stopPublishing) // if the test fails before it stops publishing
	// The pipeline runs: both groups joined and apply events.
	require.Eventually(t, func() bool { return l.committed.Load() >= 100 }, time.Minute, 20*time.Millisecond)
	l.caughtUp("before the faults")
	return l
}

// relayRetries is the relay's count of failed publishes.
func (l *kafkaLoad) relayRetries() float64 {
	return metrictest.Sum(l.t, l.relayReg, "eventline_relay_retries_total")
}

// applied is the fewest events a group has applied.
func (l *kafkaLoad) applied() int {
	n := -1
	for _, g := range l.groups {
		if m := l.count(`SELECT count(*) FROM ` + g.effects); n < 0 || m < n {
			n = m
		}
	}
	return n
}

// caughtUp waits until every group applied every event committed so far
// and returns how long that took.
func (l *kafkaLoad) caughtUp(what string) time.Duration {
	l.t.Helper()
	start, want := time.Now(), int(l.committed.Load())
	require.Eventually(l.t, func() bool { return l.applied() >= want }, 2*time.Minute, 20*time.Millisecond,
		"seed %d: %s: %d events committed, applied: %d", l.seed, what, want, l.applied())
	return time.Since(start)
}

// outage is one fault while events keep being published: begin starts
// it, it lasts d, end ends it; then every group catches up (what names the
// wait). It returns the events committed meanwhile, the relay's failed
// publishes meanwhile, and how long catching up took.
func (l *kafkaLoad) outage(what string, d time.Duration, begin, end func() error) (published int64, retried float64, recovery time.Duration) {
	l.t.Helper()
	retries, before := l.relayRetries(), l.committed.Load()
	require.NoError(l.t, begin())
	time.Sleep(d)
	require.NoError(l.t, end())
	recovery = l.caughtUp(what)
	return l.committed.Load() - before, l.relayRetries() - retries, recovery
}

// finish stops publishing, waits until both groups applied and committed
// everything, stops the consumers and the relay, and checks the outcome.
func (l *kafkaLoad) finish() {
	l.t.Helper()
	ctx := context.Background()
	l.stopPublishing()
	total := int(l.committed.Load())
	p := &pipeline{t: l.t, env: l.env, brokers: l.brokers, topic: l.topic}
	for _, g := range l.groups {
		l.waitAllApplied(ctx, l.seed, g.group, g.effects, total)
		p.waitConsumed(g.group)
	}
	// Stopped only now: had one ended by itself, runUntilStopped would have
	// failed the test.
	for _, g := range l.groups {
		g.stop()
	}
	l.stopRelay()

	dls, err := admin.ListHeld(ctx, l.env.Pool, l.env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter,
		Statuses: []admin.HeldStatus{admin.StatusHeld, admin.StatusReplayed, admin.StatusDiscarded}})
	require.NoError(l.t, err)
	require.Empty(l.t, dls, "the relay dead-lettered events")
	for _, table := range []string{"parked_events", "skipped_versions"} {
		require.Zero(l.t, l.count(`SELECT count(*) FROM `+l.table(table)), "%s must be empty", table)
	}
	require.Zero(l.t, l.count(`SELECT count(*) FROM `+l.table("held_events")+` WHERE kind <> 'relay_dead_letter'`), "no consumer dead letter or late event held")
	for _, g := range l.groups {
		l.requireAppliedOnceInOrder(l.seed, g.effects)
		require.Zero(l.t, metrictest.Sum(l.t, g.reg, "eventline_consumer_events_dead_lettered_total"), "group %s", g.name)
		l.requireVerifyClean(ctx, l.seed, g.group, g.effects, total)
	}
	l.t.Logf("%d events, all applied once in order by both groups", total)
}

// shortNetTimeouts sets a Sarama client's network timeouts to d.
func shortNetTimeouts(sc *sarama.Config, d time.Duration) {
	sc.Net.DialTimeout = d
	sc.Net.ReadTimeout = d
	sc.Net.WriteTimeout = d
}
