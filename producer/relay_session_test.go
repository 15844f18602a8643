package producer_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
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

	_, stop := runRelay(t, pool, producer.RelayConfig{Schema: env.Schema, Brokers: kafkatest.Brokers(t),
		PollInterval: 200 * time.Millisecond, RebalanceInterval: 250 * time.Millisecond, Logger: testLogger(t)})
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
