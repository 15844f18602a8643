package admin_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

func waitDrained(t *testing.T, env pgtest.Env) {
	t.Helper()
	require.Eventually(t, func() bool {
		st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
		require.NoError(t, err)
		return st.Backlog() == 0
	}, 30*time.Second, 20*time.Millisecond)
}

func TestCleanupDeletesOnlyExpiredRowsEveryGroupAcked(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	ctx := context.Background()
	cleanup := func(retention time.Duration) admin.CleanupResult {
		res, err := admin.Cleanup(ctx, env.Pool, admin.CleanupConfig{Schema: env.Schema, Retention: retention, BatchSize: 3})
		require.NoError(t, err)
		return res
	}
	offsets := sqlident.Qualify(env.Schema, outbox.OffsetsTable(0))

	// Nobody has read the shard yet: nothing may go, however old.
	relaytest.PublishOrders(t, env, topic, 3, 10, 5)
	require.Zero(t, cleanup(time.Nanosecond).Deleted)

	_, stop := relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, CleanupInterval: -1})
	waitDrained(t, env)
	stop()

	// Forwarded, but younger than the retention window.
	require.Zero(t, cleanup(time.Hour).Deleted)

	// Another watermill-sql consumer group of the same table has not
	// acknowledged anything: its rows stay.
	_, err := env.Pool.Exec(ctx, `INSERT INTO `+offsets+` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ('audit', 0, '0')`)
	require.NoError(t, err)
	require.Zero(t, cleanup(time.Nanosecond).Deleted)
	_, err = env.Pool.Exec(ctx, `DELETE FROM `+offsets+` WHERE consumer_group = 'audit'`)
	require.NoError(t, err)

	// Rows written after the relay stopped are not acknowledged: they stay.
	relaytest.PublishOrders(t, env, topic, 3, 4, 4)
	res := cleanup(time.Nanosecond)
	require.EqualValues(t, 10, res.Deleted, "deleted in batches of 3 until none is left")
	st, err := admin.ReadOutboxStatus(ctx, env.Pool, env.Schema)
	require.NoError(t, err)
	require.EqualValues(t, 4, st.Shards[0].Stored)
	require.EqualValues(t, 4, st.Shards[0].Backlog)
}

func TestRelayMetricsAndStatusCollector(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2}, 2)
	reg := prometheus.NewRegistry()
	metrics, err := producer.NewRelayMetrics(reg)
	require.NoError(t, err)
	status, err := admin.NewStatusCollector(env.Pool, env.Schema)
	require.NoError(t, err)
	require.NoError(t, reg.Register(status))

	relaytest.PublishOrders(t, env, topic, 4, 30, 10)
	require.EqualValues(t, 30, metrictest.Sum(t, reg, "eventline_outbox_backlog"))
	require.Positive(t, metrictest.Sum(t, reg, "eventline_outbox_oldest_pending_seconds"))

	_, stop := relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, Metrics: metrics})
	waitDrained(t, env)
	stop()
	require.EqualValues(t, 30, metrictest.Sum(t, reg, "eventline_relay_forwarded_total"))
	require.EqualValues(t, 30, histogramCount(t, reg, "eventline_relay_publish_latency_seconds"))
	require.Zero(t, metrictest.Sum(t, reg, "eventline_outbox_backlog"))
	require.EqualValues(t, 1, metrictest.Sum(t, reg, "eventline_outbox_up"))
}

func histogramCount(t *testing.T, g prometheus.Gatherer, name string) uint64 {
	t.Helper()
	families, err := g.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == name {
			return f.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	return 0
}
