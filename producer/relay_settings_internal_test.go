package producer

import (
	"context"
	"strconv"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
)

// TestRelayReadAppliesTheTransactionSettings: the relay's read applies its
// transaction's settings (relaySettings) when it takes the shard's fence,
// the case in which the transaction may then write and wait: its commit
// does not wait for the WAL flush, and PostgreSQL ends it after
// txTimeout+commitTimeout idle. They used to be SET LOCAL statements of
// their own.
func TestRelayReadAppliesTheTransactionSettings(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	_, err := env.Pool.Exec(ctx, newShardSQL(env.Schema, 0).zeroOffsets, outbox.RelayConsumerGroup)
	require.NoError(t, err)
	q, err := relaySchemaAdapter{outbox.SchemaAdapter(env.Schema, 500)}.SelectQuery(wsql.SelectQueryParams{
		Topic: outbox.Topic(0), ConsumerGroup: outbox.RelayConsumerGroup, OffsetsAdapter: newRelayOffsetsAdapter(env.Schema, 0)})
	require.NoError(t, err)
	settings := func(tx pgx.Tx) (syncCommit, idleTimeout string) {
		require.NoError(t, tx.QueryRow(ctx, `SELECT current_setting('synchronous_commit'),
			(SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout')`).Scan(&syncCommit, &idleTimeout))
		return syncCommit, idleTimeout
	}
	read := func() pgx.Tx {
		tx, err := env.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		for range 7 { // past PostgreSQL's custom plans: the generic plan must apply them too
			rows, err := tx.Query(ctx, q.Query, q.Args...)
			require.NoError(t, err)
			rows.Close()
			require.NoError(t, rows.Err())
		}
		return tx
	}
	plain, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defaultSync, defaultIdle := settings(plain)
	require.NoError(t, plain.Rollback(ctx))

	holder := read()
	sc, idle := settings(holder)
	require.Equal(t, "off", sc)
	require.Equal(t, strconv.FormatInt((txTimeout+commitTimeout).Milliseconds(), 10), idle)

	// Another transaction that does not get the fence reads nothing and
	// keeps the session's settings.
	other := read()
	sc, idle = settings(other)
	require.Equal(t, defaultSync, sc)
	require.Equal(t, defaultIdle, idle)
}
