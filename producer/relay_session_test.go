package producer_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// TestRelaySessionsKeepThePoolsApplicationName: operators tell services
// apart in pg_stat_activity by the application_name they give their pools.
// The relay's own sessions (ownership and LISTEN) keep it and add the
// relay's identity; before the fix they replaced it with
// "eventline-relay", so a relay's sessions could not be told from another
// service's.
func TestRelaySessionsKeepThePoolsApplicationName(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	var tag [4]byte
	_, _ = rand.Read(tag[:])
	name := "billing-svc-" + hex.EncodeToString(tag[:])
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["application_name"] = name
	cfg.MaxConns = producer.PoolSizeFor(1)
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	_, stop := relaytest.Run(t, pool, producer.RelayConfig{Schema: env.Schema, Brokers: kafkatest.Brokers(t),
		PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond, Logger: relaytest.Logger(t)})
	owners := waitOwners(t, env, 1)
	var ownership string
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT application_name FROM pg_stat_activity WHERE pid = $1`, owners[0].BackendPID).Scan(&ownership))
	require.Equal(t, name+" (eventline-relay)", ownership, "the ownership session")
	require.Eventually(t, func() bool {
		// The ownership and the LISTEN session.
		return pgtest.Count(t, env.Pool, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, name+" (eventline-relay)") == 2
	}, 30*time.Second, 20*time.Millisecond)
	stop()
}

// TestRelaySendsNothingAfterItsLeaseRanOut: a relay that cannot renew its
// lease stops relaying before anyone else may take the shard. Its timer
// stops the shard at the lease's local deadline, but a process resumed
// after a pause (SIGSTOP, a VM freeze) runs its goroutines and its fired
// timers in any order: a row the guard let through before the pause could
// be sent before the timer stopped the shard. Here the publish path is
// held (a hook) between the guard and the send while renewals are blocked
// (the lease tables locked); once the lease's deadline has passed, the
// timer is held in turn (another hook) and the publish path goes on.
// Before the fix the record reached Kafka then, after the lease had run
// out; now the deadline is checked right before each send, by the
// monotonic clock, and the next owner sends it.
func TestRelaySendsNothingAfterItsLeaseRanOut(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	metrics, err := producer.NewRelayMetrics(reg)
	require.NoError(t, err)
	cfg := producer.RelayConfig{Schema: env.Schema, Brokers: brokers, PollInterval: 200 * time.Millisecond,
		RebalanceInterval: 200 * time.Millisecond, Logger: relaytest.Logger(t)}

	held := relaytest.PublishOrders(t, env, topic, 1, 1, 1)[0]
	atSend, resume := make(chan struct{}), make(chan struct{})
	var sendOnce sync.Once
	restoreSend := producer.SetBeforeSendHook(func(schema string, _ int, eventID string) {
		if schema == env.Schema && eventID == held.ID {
			sendOnce.Do(func() { close(atSend); <-resume })
		}
	})
	defer restoreSend()
	expired, thaw := make(chan struct{}), make(chan struct{})
	var timerOnce sync.Once
	restoreTimer := producer.SetLeaseTimerHook(func(schema string, _ int) {
		if schema == env.Schema {
			timerOnce.Do(func() { close(expired); <-thaw })
		}
	})
	defer restoreTimer()
	defer close(thaw)

	_, stop := relaytest.Run(t, env.Pool, withMetrics(cfg, metrics))
	waitFor(t, atSend, "the relay never reached the send")
	lock, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = lock.Rollback(ctx) }()
	_, err = lock.Exec(ctx, `LOCK TABLE `+sqlident.Qualify(env.Schema, "relay_leases")+`, `+sqlident.Qualify(env.Schema, "relay_members")+` IN EXCLUSIVE MODE`)
	require.NoError(t, err)
	waitFor(t, expired, "the shard's lease never ran out")
	close(resume)
	// The publish path decides: it stops the shard for its lease (counted),
	// or it sends, and the batch's position moves once Kafka has the record.
	require.Eventually(t, func() bool {
		_, offset, err := positionOf(ctx, env.Pool, env.Schema, 0)
		require.NoError(t, err)
		return offset > 0 || counted(reg, "eventline_relay_lease_expired_total")
	}, time.Minute, 10*time.Millisecond)
	stop() // Run returns once its Kafka producer has flushed what it was given
	require.Zero(t, highWatermark(t, brokers, topic), "the event was sent after the relay's lease had run out")

	// Not lost: the next owner sends it.
	require.NoError(t, lock.Rollback(ctx))
	_, stop = relaytest.Run(t, env.Pool, cfg)
	relaytest.RequireAllDelivered(t, brokers, topic, []string{held.ID}, time.Minute)
	stop()
}

func waitFor(t *testing.T, ch <-chan struct{}, msg string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(time.Minute):
		t.Fatal(msg)
	}
}

// highWatermark returns the offset after the last record of topic's
// partition 0.
func highWatermark(t *testing.T, brokers []string, topic string) int64 {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	client, err := sarama.NewClient(brokers, cfg)
	require.NoError(t, err)
	defer client.Close()
	hw, err := client.GetOffset(topic, 0, sarama.OffsetNewest)
	require.NoError(t, err)
	return hw
}

// counted reports whether the counter name has counted anything yet.
func counted(reg *prometheus.Registry, name string) bool {
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				if m.GetCounter().GetValue() > 0 {
					return true
				}
			}
		}
	}
	return false
}
