package verify_test

import (
	"context"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin/verify"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
)

// BenchmarkVerify runs verify over VERIFY_BENCH_EVENTS outbox events
// (default 20000) in 4 shards, applied by one group except one in a
// thousand (which verify finds lost), next to a baseline that only scans
// the same rows: one pass reading each outbox row's event id, one counting
// processed_events. Compare the sub-benchmarks' ns/op as a ratio; peak-MB
// is the largest Go heap seen during a run.
//
//	VERIFY_BENCH_EVENTS=1000000 go test -run '^$' -bench Verify -benchtime 1x ./admin/verify/
func BenchmarkVerify(b *testing.B) {
	n := 20000
	if v, err := strconv.Atoi(os.Getenv("VERIFY_BENCH_EVENTS")); err == nil && v > 0 {
		n = v
	}
	ctx := context.Background()
	env := pgtest.New(b, pgtest.Options{Shards: 4, MaxConns: 4})
	cons := pgtest.New(b, pgtest.Options{Shards: 1, MaxConns: 4})
	start := time.Now()
	for s := 0; s < env.Shards; s++ {
		_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, outbox.Table(s))+` (uuid, payload, metadata, transaction_id)
			SELECT gen_random_uuid()::text, json_build_object('destination_topic', 'orders', 'uuid', 'e-' || i, 'payload', '',
				'metadata', json_build_object('event_id', 'e-' || i, 'event_type', 'order.updated', 'aggregate_type', 'order',
					'aggregate_id', 'a-' || (i / 10), 'aggregate_version', ((i % 10) + 1)::text)), '{}'::json, pg_current_xact_id()
			FROM generate_series(0, $1::int - 1) i WHERE (i / 10) % 4 = $2`, n, s)
		require.NoError(b, err)
		_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, outbox.OffsetsTable(s))+`
			(consumer_group, offset_acked, last_processed_transaction_id)
			SELECT $1, "offset", transaction_id FROM `+sqlident.Qualify(env.Schema, outbox.Table(s))+`
			ORDER BY transaction_id DESC, "offset" DESC LIMIT 1`, outbox.RelayConsumerGroup)
		require.NoError(b, err)
	}
	_, err := cons.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(cons.Schema, "processed_events")+`
		(consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
		SELECT 'billing', 'e-' || i, 'order.updated', 'order', 'a-' || (i / 10), (i % 10) + 1, 'applied'
		FROM generate_series(0, $1::int - 1) i WHERE i % 1000 <> 7`, n)
	require.NoError(b, err)
	_, err = cons.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(cons.Schema, "aggregate_versions")+`
		(consumer_group, aggregate_type, aggregate_id, version)
		SELECT 'billing', 'order', 'a-' || a, 10 FROM generate_series(0, ($1::int - 1) / 10) a`, n)
	require.NoError(b, err)
	for _, e := range []pgtest.Env{env, cons} {
		_, err := e.Pool.Exec(ctx, `ANALYZE`)
		require.NoError(b, err)
	}
	b.Logf("seeded %d events in %s", n, time.Since(start).Round(time.Millisecond))
	wantLost := int64(n / 1000)
	if n%1000 > 7 {
		wantLost++
	}

	cfg := verify.Config{Schema: env.Schema, ConsumerSchema: cons.Schema, GroupTopics: map[string][]string{"billing": {"orders"}}}
	if os.Getenv("VERIFY_BENCH_DEBUG") != "" {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	b.Run("baseline-scan", func(b *testing.B) {
		for b.Loop() {
			var total, records int64
			for s := 0; s < env.Shards; s++ {
				var c int64
				require.NoError(b, env.Pool.QueryRow(ctx, `SELECT count(payload->>'uuid') FROM `+sqlident.Qualify(env.Schema, outbox.Table(s))).Scan(&c))
				total += c
			}
			require.NoError(b, cons.Pool.QueryRow(ctx, `SELECT count(*) FROM `+sqlident.Qualify(cons.Schema, "processed_events")).Scan(&records))
			require.EqualValues(b, n, total)
		}
	})
	b.Run("same-database", func(b *testing.B) {
		peak := watchHeap(b)
		for b.Loop() {
			rep, err := verify.Run(ctx, env.Pool, nil, cfg)
			require.NoError(b, err)
			require.Equal(b, wantLost, rep.Groups[0].Lost)
		}
		peak()
	})
	b.Run("separate-database", func(b *testing.B) {
		peak := watchHeap(b)
		for b.Loop() {
			rep, err := verify.Run(ctx, env.Pool, cons.Pool, cfg)
			require.NoError(b, err)
			require.Equal(b, wantLost, rep.Groups[0].Lost)
		}
		peak()
	})
}

// watchHeap samples the Go heap until the returned function is called,
// which reports the peak as peak-MB.
func watchHeap(b *testing.B) func() {
	runtime.GC()
	var mu sync.Mutex
	var peak uint64
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		var m runtime.MemStats
		for {
			select {
			case <-done:
				return
			case <-t.C:
				runtime.ReadMemStats(&m)
				mu.Lock()
				peak = max(peak, m.HeapInuse)
				mu.Unlock()
			}
		}
	}()
	return func() {
		close(done)
		<-stopped
		mu.Lock()
		defer mu.Unlock()
		b.ReportMetric(float64(peak)/1e6, "peak-MB")
	}
}
