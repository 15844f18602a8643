package producer_test

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// exchangeTracer records what a relay's pool sends, one entry per round
// trip: a statement sent alone, or the statements of one batch.
type exchangeTracer struct {
	mu        sync.Mutex
	exchanges [][]string
	open      map[*pgx.Conn]int // the exchange a connection's batch is filling
}

func (tr *exchangeTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	tr.mu.Lock()
	tr.exchanges = append(tr.exchanges, []string{data.SQL})
	tr.mu.Unlock()
	return ctx
}

func (tr *exchangeTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (tr *exchangeTracer) TraceBatchStart(ctx context.Context, conn *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	tr.mu.Lock()
	tr.exchanges = append(tr.exchanges, nil)
	tr.open[conn] = len(tr.exchanges) - 1
	tr.mu.Unlock()
	return ctx
}

func (tr *exchangeTracer) TraceBatchQuery(_ context.Context, conn *pgx.Conn, data pgx.TraceBatchQueryData) {
	tr.mu.Lock()
	i := tr.open[conn]
	tr.exchanges[i] = append(tr.exchanges[i], data.SQL)
	tr.mu.Unlock()
}

func (tr *exchangeTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (tr *exchangeTracer) snapshot() [][]string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return append([][]string(nil), tr.exchanges...)
}

func startsWith(sql, prefix string) bool {
	return strings.HasPrefix(strings.ToUpper(strings.TrimSpace(sql)), prefix)
}

// TestRelayTransactionTakesTwoRoundTrips: a relay transaction sends BEGIN
// and the read (which applies the transaction's settings) in one round
// trip, and the position write and COMMIT in another: four statements.
// Before, BEGIN (with its settings, SET LOCAL statements), the read, the
// position write and COMMIT were four round trips and six statements.
func TestRelayTransactionTakesTwoRoundTrips(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 2}, 2)
	tr := &exchangeTracer{open: map[*pgx.Conn]int{}}
	cfg := env.Pool.Config().Copy()
	cfg.ConnConfig.Tracer = tr
	cfg.MaxConns = producer.PoolSizeFor(env.Shards)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	relaytest.Start(t, pgtest.Env{Pool: pool, Schema: env.Schema, Shards: env.Shards}, producer.RelayConfig{Brokers: brokers})

	// Events one at a time, once the shards have started, so that most
	// batches hold one.
	require.Eventually(t, func() bool { return waitingShards(t, env) == env.Shards }, 15*time.Second, 10*time.Millisecond)
	var ids []string
	for range 10 {
		ids = append(ids, relaytest.IDs(relaytest.PublishOrders(t, env, topic, 3, 1, 1))...)
		time.Sleep(20 * time.Millisecond)
	}
	relaytest.RequireAllDelivered(t, brokers, topic, ids, 30*time.Second)
	require.Eventually(t, func() bool {
		st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
		require.NoError(t, err)
		return st.Backlog() == 0
	}, 30*time.Second, 10*time.Millisecond)

	var reads, writes int
	for _, ex := range tr.snapshot() {
		for i, sql := range ex {
			switch {
			case strings.Contains(sql, "WITH last_processed AS"):
				reads++
				require.Len(t, ex, 2, "the read travels with BEGIN: %q", ex)
				require.True(t, startsWith(ex[0], "BEGIN"), "%q", ex)
				require.Equal(t, 1, i, "%q", ex)
			case strings.Contains(sql, "offset_acked = excluded.offset_acked"):
				writes++
				require.True(t, startsWith(ex[len(ex)-1], "COMMIT"), "the position write travels with COMMIT: %q", ex)
			case len(ex) == 1 && (startsWith(sql, "BEGIN ISOLATION LEVEL REPEATABLE READ") || startsWith(sql, "SET LOCAL")):
				// (A shard's set-up runs a READ COMMITTED transaction of
				// its own, once.)
				t.Fatalf("a relay transaction sent %q in a round trip of its own", sql)
			}
		}
	}
	t.Logf("%d reads, %d position writes for %d events", reads, writes, len(ids))
	// How many batches the ten events make depends on the machine's load
	// (a slow broker gathers them into one); each batch's shape does not.
	require.Positive(t, reads)
	require.Positive(t, writes)
}

// lockedBuffer is a log sink safe for concurrent writers.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestRelayNeverOverwritesAPositionMovedDuringItsBatch: a relay
// transaction reads under REPEATABLE READ, so its position write fails
// when another writer moved the position after it read (two relays that
// both believe they own the shard); its COMMIT, sent in the same round
// trip, must then not run, and the newer position stays. Here the other
// writer moves the position past B while the relay's batch holds A.
func TestRelayNeverOverwritesAPositionMovedDuringItsBatch(t *testing.T) {
	t.Parallel()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1}, 1)
	ctx := context.Background()
	evs := relaytest.PublishOrders(t, env, topic, 1, 2, 1) // A, then B, in transactions of their own
	a, b := evs[0], evs[1]
	offsets := sqlident.Qualify(env.Schema, outbox.OffsetsTable(0))
	var bTx string
	var bOffset int64
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT transaction_id::text, "offset" FROM `+sqlident.Qualify(env.Schema, outbox.Table(0))+
		` ORDER BY transaction_id DESC, "offset" DESC LIMIT 1`).Scan(&bTx, &bOffset))

	var once sync.Once
	moved := make(chan struct{})
	logs := &lockedBuffer{}
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, BatchSize: 1,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
		AfterPublish: func(_ int, ids []string) error {
			once.Do(func() {
				require.Equal(t, []string{a.ID}, ids)
				_, err := env.Pool.Exec(ctx, `UPDATE `+offsets+` SET last_processed_transaction_id = $1::text::xid8, offset_acked = $2 WHERE consumer_group = $3`,
					bTx, bOffset, outbox.RelayConsumerGroup)
				require.NoError(t, err)
				close(moved)
			})
			return nil
		}})
	relaytest.RequireAllDelivered(t, brokers, topic, []string{a.ID}, 30*time.Second)
	<-moved
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "record relay progress") }, 10*time.Second, 10*time.Millisecond,
		"the relay's write of A's position must fail")
	time.Sleep(1500 * time.Millisecond) // the shard reads again after queryRetryInterval (1s)
	tx, off, err := positionOf(ctx, env.Pool, env.Schema, 0)
	require.NoError(t, err)
	require.Equal(t, bTx, strconv.FormatUint(tx, 10), "the position moved back")
	require.Equal(t, bOffset, off, "the position moved back")
	recs := relaytest.ReadUntil(t, brokers, topic, time.Second, func([]relaytest.Record) bool { return false })
	require.Zero(t, relaytest.Distinct(recs)[b.ID], "B, behind the moved position, was read again")
}
