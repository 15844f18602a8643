package producer_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/childproc"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/producer"
)

// Tests that need a relay to die for real re-run this test binary as a
// child process that only runs a relay; TestMain recognizes it by these
// environment variables.
const (
	envChild            = "EVENTLINE_TEST_CHILD"
	envSchema           = "EVENTLINE_TEST_SCHEMA"
	envBrokers          = "EVENTLINE_TEST_BROKERS"
	envCrashAfterPublsh = "EVENTLINE_TEST_CRASH_AFTER_PUBLISH"
	envDatabaseURL      = "EVENTLINE_TEST_DATABASE_URL" // default pgtest.URL()
	envRebalance        = "EVENTLINE_TEST_REBALANCE"    // default 250ms
	envRelayID          = "EVENTLINE_TEST_RELAY_ID"
)

func TestMain(m *testing.M) {
	if os.Getenv(envChild) == "relay" {
		os.Exit(runRelayChild())
	}
	goleak.VerifyTestMain(m,
		// Sarama's metrics library starts one process-wide ticker.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// runRelayChild runs a relay until SIGTERM. With envCrashAfterPublish set,
// it kills itself with SIGKILL after Kafka acknowledged its first batch and
// before the outbox recorded it: the seed article's crash window.
func runRelayChild() int {
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	url := pgtest.URL()
	if u := os.Getenv(envDatabaseURL); u != "" {
		url = u
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	cfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer pool.Close()
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	rebalance := 250 * time.Millisecond
	if d, err := time.ParseDuration(os.Getenv(envRebalance)); err == nil {
		rebalance = d
	}
	rc := producer.RelayConfig{
		Schema:            os.Getenv(envSchema),
		Brokers:           kafkaconf.ParseBrokers(os.Getenv(envBrokers)),
		ID:                os.Getenv(envRelayID),
		PollInterval:      200 * time.Millisecond,
		RebalanceInterval: rebalance,
		BatchSize:         50,
		Logger:            slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})),
	}
	if os.Getenv(envCrashAfterPublsh) != "" {
		rc.AfterPublish = func(int, []string) error {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // never acknowledge
		}
	}
	relay, err := producer.NewRelay(ctx, pool, rc)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if err := relay.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// startRelayProcess runs a relay in a child process on env's outbox.
func startRelayProcess(t *testing.T, env pgtest.Env, brokers []string, extraEnv ...string) *childproc.Proc {
	t.Helper()
	return childproc.Start(t, append([]string{envChild + "=relay", envSchema + "=" + env.Schema, envBrokers + "=" + strings.Join(brokers, ",")}, extraEnv...)...)
}

// waitOwners waits until every shard is owned, by exactly owners distinct
// relays, none holding more than its fair share.
func waitOwners(t *testing.T, env pgtest.Env, owners int) map[int]admin.ShardOwner {
	t.Helper()
	share := (env.Shards + owners - 1) / owners
	var last map[int]admin.ShardOwner
	require.Eventually(t, func() bool {
		var err error
		last, err = admin.ShardOwners(context.Background(), env.Pool, env.Schema)
		require.NoError(t, err)
		perOwner := map[string]int{}
		for _, o := range last {
			perOwner[o.Instance]++
		}
		for _, n := range perOwner {
			if n > share {
				return false
			}
		}
		return len(last) == env.Shards && len(perOwner) == owners
	}, 30*time.Second, 50*time.Millisecond, "want %d shards over %d relays, at most %d each", env.Shards, owners, share)
	return last
}

func TestRelayProcessesShareShardsAndTakeOverAfterKill9(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 8, MaxConns: 8}, 6)

	relays := []*childproc.Proc{
		startRelayProcess(t, env, brokers),
		startRelayProcess(t, env, brokers),
		startRelayProcess(t, env, brokers),
	}
	waitOwners(t, env, 3) // 3, 3 and 2 shards

	// Publish while one relay is killed with SIGKILL halfway through.
	var events []string
	var mu sync.Mutex
	published := make(chan struct{})
	go func() {
		defer close(published)
		for i := 0; i < 20; i++ {
			evs := relaytest.PublishOrders(t, env, topic, 64, 100, 10)
			mu.Lock()
			for _, e := range evs {
				events = append(events, e.ID)
			}
			mu.Unlock()
			if i == 10 {
				relays[0].Kill()
			}
		}
	}()
	<-published
	waitOwners(t, env, 2)

	mu.Lock()
	want := append([]string(nil), events...)
	mu.Unlock()
	records := readTopic(t, brokers, topic, len(want), time.Minute)
	counts := relaytest.Distinct(records)
	for _, id := range want {
		require.GreaterOrEqual(t, counts[id], 1, "event %s lost after a relay was killed", id)
	}

	// Per aggregate, first deliveries come in version order whichever relay
	// held the shard; a crash only adds re-sent copies.
	firstSeen := map[string]bool{}
	last := map[string]int64{}
	for _, r := range records {
		if firstSeen[r.EventID] {
			continue
		}
		firstSeen[r.EventID] = true
		require.Greater(t, r.Version, last[r.Key], "aggregate %s: version %d delivered after %d", r.Key, r.Version, last[r.Key])
		last[r.Key] = r.Version
	}
}

func TestRelayCrashAfterKafkaAckBeforeOutboxAck(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2}, 3)
	events := relaytest.PublishOrders(t, env, topic, 1, 1, 1)

	// The child publishes, Kafka acknowledges, and the child dies by
	// SIGKILL before recording it in the outbox.
	crashing := startRelayProcess(t, env, brokers, envCrashAfterPublsh+"=1")
	select {
	case <-crashing.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("relay child did not crash")
	}
	require.True(t, crashing.KilledBy(syscall.SIGKILL), "child must die by SIGKILL, got %v", crashing.Err())
	require.Equal(t, 1, relaytest.Distinct(readTopic(t, brokers, topic, 1, 10*time.Second))[events[0].ID], "published_after_crash=1")
	st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.Backlog(), "the outbox never recorded the publish")

	// A new relay publishes it again: a duplicate, never a loss.
	_, stop := relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers})
	recs := relaytest.ReadUntil(t, brokers, topic, 30*time.Second, func(r []relaytest.Record) bool { return len(r) >= 2 })
	require.Len(t, recs, 2, "published_after_retry=2")
	require.Equal(t, recs[0].EventID, recs[1].EventID)
	stop()
	st, err = admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
	require.NoError(t, err)
	require.Zero(t, st.Backlog())
}

// TestRelayProcessesTakeOverFromLiveFrozenAndStoppedRelays runs relays as
// real processes under continuous publishing and moves shards between
// them: from a relay that is still running (a rebalance), from one whose
// database connections freeze (a proxy stops forwarding without closing,
// as a vanished host looks), and from one stopped with SIGSTOP. The frozen
// and stopped relays come back afterwards. Every event is relayed, and no
// shard's position ever moves backwards.
func TestRelayProcessesTakeOverFromLiveFrozenAndStoppedRelays(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 6, MaxConns: 12}, 6)
	proxy := startProxy(t)
	const interval = 200 * time.Millisecond
	bound := producer.TakeoverBound(interval)
	child := func(id string, extra ...string) *childproc.Proc {
		return startRelayProcess(t, env, brokers, append(extra, envRelayID+"="+id, envRebalance+"="+interval.String())...)
	}

	watch := watchPositions(t, env)
	defer watch()
	pub := startPublisher(t, env, topic, 64)

	a := child("a", envDatabaseURL+"="+pgtest.URLVia(proxy.Addr()))
	waitOwnedBy(t, env, "a", 30*time.Second)
	b := child("b")
	waitOwners(t, env, 2) // taken over from a running relay
	waitRelayedPastNow(t, env, 90*time.Second, "relayed after the rebalance")

	frozenAt := time.Now()
	proxy.Set(faultproxy.Freeze)
	frozen := waitOwnedBy(t, env, "b", time.Minute)
	waitRelayedPastNow(t, env, 90*time.Second, "relayed after a's connections froze")
	frozenRelayed := time.Since(frozenAt)

	c := child("c")
	waitOwners(t, env, 2)
	waitRelayedPastNow(t, env, 90*time.Second, "relayed after the second rebalance")
	stoppedAt := time.Now()
	require.NoError(t, b.Signal(syscall.SIGSTOP))
	stopped := waitOwnedBy(t, env, "c", time.Minute)
	waitRelayedPastNow(t, env, 90*time.Second, "relayed after b was stopped")
	stoppedRelayed := time.Since(stoppedAt)
	t.Logf("takeover with RebalanceInterval %s (bound %s): frozen connections: owned after %s, relaying after %s; SIGSTOP: owned after %s, relaying after %s",
		interval, bound, frozen.Round(time.Millisecond), frozenRelayed.Round(time.Millisecond), stopped.Round(time.Millisecond), stoppedRelayed.Round(time.Millisecond))

	// The vanished relays come back: they must have stopped relaying
	// their lost shards, and they rejoin.
	require.NoError(t, b.Signal(syscall.SIGCONT))
	proxy.Set(faultproxy.Pass)
	waitOwners(t, env, 3)
	waitRelayedPastNow(t, env, 90*time.Second, "relayed after the relays came back")
	pub.finish()
	relaytest.RequireAllDelivered(t, brokers, topic, pub.committed(), time.Minute)
	watch()
	_ = a
	_ = c
}
