package e2e_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/childproc"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// The chaos tests run relays and consumers as child processes of this
// test binary, so they can be killed and frozen for real; TestMain
// recognizes a child by these environment variables.
const (
	envChild   = "EVENTLINE_E2E_CHILD"
	envSchema  = "EVENTLINE_E2E_SCHEMA"
	envBrokers = "EVENTLINE_E2E_BROKERS"
	envRelayID = "EVENTLINE_E2E_RELAY_ID"
	// envChaosSeed seeds the chaos test's schedule; a failure's log names
	// the seed to run it again with.
	envChaosSeed = "EVENTLINE_CHAOS_SEED"
)

func TestMain(m *testing.M) {
	switch os.Getenv(envChild) {
	case "relay":
		os.Exit(runRelayChild())
	case "consumer":
		os.Exit(runConsumerChild()) // consumer_chaos_test.go
	}
	os.Exit(m.Run())
}

// runChild is a child process's main: with a context that SIGTERM ends and
// a pool of maxConns connections to the test database, it builds the
// child's relay or consumer and runs it until SIGTERM. It returns the exit
// status: 2 if the pool or build fails, 1 if Run does, 0 after a clean stop.
func runChild(maxConns int32, build func(ctx context.Context, pool *pgxpool.Pool) (interface{ Run(context.Context) error }, error)) int {
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	pcfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	pcfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer pool.Close()
	child, err := build(ctx, pool)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if err := child.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// chaosRelayConfig is the configuration of the chaos tests' relays: short
// retry waits and rebalance interval, so the faults are outlived quickly.
func chaosRelayConfig(schema string, brokers []string) producer.RelayConfig {
	return producer.RelayConfig{
		Schema:            schema,
		Brokers:           brokers,
		PollInterval:      100 * time.Millisecond,
		RebalanceInterval: 250 * time.Millisecond,
		Backoff:           eventline.Backoff{Initial: 50 * time.Millisecond, Multiplier: 2, Max: 200 * time.Millisecond},
		Logger:            testLogger(),
	}
}

// runRelayChild runs a relay (chaosRelayConfig) until SIGTERM.
func runRelayChild() int {
	return runChild(8, func(ctx context.Context, pool *pgxpool.Pool) (interface{ Run(context.Context) error }, error) {
		cfg := chaosRelayConfig(os.Getenv(envSchema), kafkaconf.ParseBrokers(os.Getenv(envBrokers)))
		cfg.ID = os.Getenv(envRelayID)
		return producer.NewRelay(ctx, pool, cfg)
	})
}

// relayChild is a relay running in a child process.
type relayChild struct {
	id string
	*childproc.Proc
}

func startRelayChild(t *testing.T, schema string, brokers []string, id string) *relayChild {
	t.Helper()
	return &relayChild{id: id, Proc: childproc.Start(t, envChild+"=relay", envSchema+"="+schema, envBrokers+"="+strings.Join(brokers, ","), envRelayID+"="+id)}
}

// longChaosTest starts a chaos test that runs for a while (why says how
// long): skipped with -short, else run in parallel with the others, with
// its seed (chaosSeed).
func longChaosTest(t *testing.T, why string) (uint64, *rand.Rand) {
	t.Helper()
	if testing.Short() {
		t.Skip(why)
	}
	t.Parallel()
	return chaosSeed(t)
}

func chaosSeed(t *testing.T) (uint64, *rand.Rand) {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv(envChaosSeed); s != "" {
		var err error
		seed, err = strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "%s must be a number", envChaosSeed)
	}
	t.Logf("%s seed %d (rerun with %s=%d)", t.Name(), seed, envChaosSeed, seed)
	return seed, rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

// TestChaosLosesNothing runs producer ▸ two relays (child processes) ▸
// Kafka ▸ a consumer on a proxied pool while a seeded schedule of faults
// plays: relays killed with SIGKILL (and replaced) or frozen with SIGSTOP
// for a while, the consumer's database refused and reset, Kafka refusing
// produce requests with a retriable error (kfake) or connections (Apache
// Kafka). Then, faults over, every event must be applied once, in order,
// and admin/verify must report nothing:
// no problem, no warning (nothing lost, dead-lettered, skipped or applied
// twice). Rerun a failure with EVENTLINE_CHAOS_SEED set to the logged seed.
func TestChaosLosesNothing(t *testing.T) {
	seed, rng := longChaosTest(t, "chaos runs for about half a minute")
	ctx := context.Background()

	env := pgtest.New(t, pgtest.Options{Shards: 2, MaxConns: 8})
	r := newRig(t, env, env.Pool, kafkatest.WithFaults(t), "chaos", 3, nil)
	r.startProxy()
	effects := r.table("chaos_effects")
	_, err := env.Pool.Exec(ctx, `CREATE TABLE `+effects+` (seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL)`)
	require.NoError(t, err)

	// The consumer: default park timeout (an hour: nothing may be skipped
	// in this run), its pool through the proxy.
	group := kafkatest.Topic(t, "chaos") // unique: the broker may be shared
	reg := prometheus.NewRegistry()
	metrics, err := middleware.NewMetrics(reg)
	require.NoError(t, err)
	cfg := r.consumerConfig(group, versioning.HoldLate, metrics)
	cfg.ParkTimeout = 0
	c, err := consumer.New(r.proxiedPool(), cfg)
	require.NoError(t, err)
	require.NoError(t, c.Handle("order.updated", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+effects+` (event_id, aggregate_id, version) VALUES ($1, $2, $3)`, e.ID, e.AggregateID, e.AggregateVersion)
		return err
	}))
	stopConsumer := relaytest.Background(t, c.Run)

	var relays []*relayChild
	relayN := 0
	newRelay := func() *relayChild {
		relayN++
		rc := startRelayChild(t, env.Schema, r.brokers, fmt.Sprintf("chaos-%d", relayN))
		return rc
	}
	relays = append(relays, newRelay(), newRelay())

	// The producer: 16 aggregates, a few events at a time, until the
	// chaos ends.
	stopPublishing, published := r.publishAll(ctx, seed)

	// The chaos: one fault at a time, each for 0.3 to 2 s, for 20 s.
	chaosEnd := time.Now().Add(20 * time.Second)
	var log []string
	for time.Now().Before(chaosEnd) {
		hold := time.Duration(300+rng.IntN(1700)) * time.Millisecond
		switch rng.IntN(4) {
		case 0:
			i := rng.IntN(len(relays))
			log = append(log, "kill -9 "+relays[i].id)
			relays[i].Kill()
			relays[i] = newRelay()
		case 1:
			i := rng.IntN(len(relays))
			log = append(log, fmt.Sprintf("SIGSTOP %s for %s", relays[i].id, hold))
			require.NoError(t, relays[i].Signal(syscall.SIGSTOP))
			time.Sleep(hold) // the fault's duration
			require.NoError(t, relays[i].Signal(syscall.SIGCONT))
		case 2:
			log = append(log, fmt.Sprintf("consumer database refused for %s", hold))
			r.proxy.Set(faultproxy.Refuse)
			r.proxy.Drop()
			time.Sleep(hold) // the fault's duration
			r.proxy.Set(faultproxy.Pass)
		case 3:
			if r.cluster.Fake != nil {
				n := 1 + rng.IntN(4)
				log = append(log, fmt.Sprintf("Kafka refuses %d produce requests (NOT_ENOUGH_REPLICAS)", n))
				r.cluster.Fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: n})
				break
			}
			// Apache Kafka cannot be made to refuse produces with a
			// retriable error on one node (min.insync.replicas above the
			// replication factor is capped at it, see
			// TestApacheKafkaCapsMinInsyncAtTheReplicationFactor): its
			// clients lose it instead.
			log = append(log, fmt.Sprintf("Kafka refuses connections for %s", hold))
			r.cluster.Proxy.Set(faultproxy.Refuse)
			r.cluster.Proxy.Drop()
			time.Sleep(hold) // the fault's duration
			r.cluster.Proxy.Set(faultproxy.Pass)
		}
		time.Sleep(time.Duration(100+rng.IntN(400)) * time.Millisecond) // calm between faults
	}
	stopPublishing()
	total := published()
	t.Logf("%d events; faults: %s", total, strings.Join(log, "; "))

	// Faults over: everything arrives, once, in order.
	r.waitAllApplied(ctx, seed, group, effects, total)
	p := &pipeline{t: t, env: env, brokers: r.brokers, topic: r.topic}
	p.waitConsumed(group)
	stopConsumer()
	for _, rc := range relays {
		_ = rc.Signal(syscall.SIGTERM)
		<-rc.Done()
	}
	r.requireAppliedOnceInOrder(seed, effects)
	r.requireVerifyClean(ctx, seed, group, effects, total)
}
