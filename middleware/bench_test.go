package middleware_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
)

// The benchmarks compare the composed middleware with a bare handler doing
// the same business insert in its own transaction, at the same concurrency
// (benchParallelism × GOMAXPROCS goroutines; 12 on two cores). Run both in
// one invocation and compare ns/op:
//
//	go test -run '^$' -bench 'BenchmarkBareHandler|BenchmarkMiddleware' -benchtime 5s ./middleware/
//
// BenchmarkBareBatch and BenchmarkBatchMiddleware do the same with 16 events
// per transaction (one batch). Every benchmark also reports CPU per
// event, of this process (go-µs/ev) and of its PostgreSQL backends
// (pg-µs/ev): on a shared machine those vary much less than events/s.
//
// With EVENTLINE_BENCH_RTT set (e.g. 500us), both talk to PostgreSQL
// through a proxy adding that round-trip time, as when the database runs
// on another host; on loopback they measure CPU cost instead.

const (
	benchParallelism = 6
	benchAggregates  = 50 // per goroutine, events applied round robin
)

type benchEnv struct {
	env    consumertest.Env
	pool   *pgxpool.Pool // the pool the benchmark works through
	insert string
}

func newBenchEnv(b testing.TB) benchEnv {
	b.Helper()
	env := consumertest.New(b, pgtest.Options{MaxConns: 16})
	table := sqlident.Qualify(env.Schema, "bench_effects")
	_, err := env.Pool.Exec(context.Background(), `CREATE TABLE `+table+` (
		id bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL, payload jsonb NOT NULL)`)
	require.NoError(b, err)
	return benchEnv{env: env, pool: benchPool(b, env), insert: `INSERT INTO ` + table + ` (event_id, aggregate_id, version, payload) VALUES ($1, $2, $3, $4)`}
}

// benchPool returns a pool of 16 connections named benchAppName, through a
// latency proxy when EVENTLINE_BENCH_RTT is set.
func benchPool(b testing.TB, env consumertest.Env) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(b, err)
	cfg.MaxConns = 16
	cfg.ConnConfig.RuntimeParams["application_name"] = benchAppName
	if rtt := os.Getenv("EVENTLINE_BENCH_RTT"); rtt != "" {
		d, err := time.ParseDuration(rtt)
		require.NoError(b, err)
		addr := consumertest.LatencyProxy(b, fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port), d)
		host, port, _ := net.SplitHostPort(addr)
		p, _ := strconv.Atoi(port)
		cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(p)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(b, err)
	b.Cleanup(pool.Close)
	return pool
}

// business is the handler's work: one insert.
func (be benchEnv) business(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
	_, err := tx.Exec(ctx, be.insert, e.ID, e.AggregateID, e.AggregateVersion, e.Payload)
	return err
}

// events yields, per goroutine, in-order events over its own aggregates.
func benchEvents(worker int64) func() eventline.Event {
	versions := make([]int64, benchAggregates)
	i := 0
	return func() eventline.Event {
		a := i % benchAggregates
		i++
		versions[a]++
		return consumertest.Event(fmt.Sprintf("w%d-a%d", worker, a), versions[a])
	}
}

func BenchmarkBareHandler(b *testing.B) {
	be := newBenchEnv(b)
	ctx := context.Background()
	var workers atomic.Int64
	b.SetParallelism(benchParallelism)
	b.ResetTimer()
	meter := cpuMeter(b, be.pool)
	b.RunParallel(func(pb *testing.PB) {
		next := benchEvents(workers.Add(1))
		for pb.Next() {
			e := next()
			msg, err := eventline.Encode(e)
			if err != nil {
				b.Error(err)
				return
			}
			err = pgx.BeginFunc(ctx, be.pool, func(tx pgx.Tx) error {
				d, err := eventline.Decode(msg)
				if err != nil {
					return err
				}
				return be.business(ctx, tx, d)
			})
			if err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	meter(int64(b.N))
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
}

func BenchmarkMiddleware(b *testing.B) {
	be := newBenchEnv(b)
	el, err := middleware.New(be.pool, middleware.Config{Schema: be.env.Schema, Group: "bench", Logger: quiet()})
	require.NoError(b, err)
	h := el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, _ := middleware.TxFromContext(ctx)
		e, _ := middleware.EventFromContext(ctx)
		return nil, be.business(ctx, tx, e)
	})
	var workers atomic.Int64
	b.SetParallelism(benchParallelism)
	b.ResetTimer()
	meter := cpuMeter(b, be.pool)
	b.RunParallel(func(pb *testing.PB) {
		next := benchEvents(workers.Add(1))
		for pb.Next() {
			msg, err := eventline.Encode(next())
			if err != nil {
				b.Error(err)
				return
			}
			if _, err := h(msg); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	meter(int64(b.N))
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
	require.Equal(b, 0, pgtest.Count(b, be.env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(be.env.Schema, "parked_events")))
}

// benchBatch is the batch size of the batch benchmarks.
const benchBatch = 16

// BenchmarkBareBatch is BenchmarkBareHandler applying benchBatch events per
// transaction: the baseline for BenchmarkBatchMiddleware.
func BenchmarkBareBatch(b *testing.B) {
	be := newBenchEnv(b)
	ctx := context.Background()
	var workers, done atomic.Int64
	b.SetParallelism(benchParallelism)
	b.ResetTimer()
	meter := cpuMeter(b, be.pool)
	b.RunParallel(func(pb *testing.PB) {
		next := benchEvents(workers.Add(1))
		for more := true; more; {
			var msgs []*message.Message
			for len(msgs) < benchBatch {
				if more = pb.Next(); !more {
					break
				}
				msg, err := eventline.Encode(next())
				if err != nil {
					b.Error(err)
					return
				}
				msgs = append(msgs, msg)
			}
			if len(msgs) == 0 {
				return
			}
			err := pgx.BeginFunc(ctx, be.pool, func(tx pgx.Tx) error {
				for _, msg := range msgs {
					d, err := eventline.Decode(msg)
					if err != nil {
						return err
					}
					if err := be.business(ctx, tx, d); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				b.Error(err)
				return
			}
			done.Add(int64(len(msgs)))
		}
	})
	b.StopTimer()
	meter(done.Load())
	b.ReportMetric(float64(done.Load())/b.Elapsed().Seconds(), "events/s")
}

// BenchmarkBatchMiddleware applies benchBatch events per transaction
// through the composed middleware (one batch), each member on its
// own goroutine as a Router runs them.
func BenchmarkBatchMiddleware(b *testing.B) {
	be := newBenchEnv(b)
	el, err := middleware.New(be.pool, middleware.Config{Schema: be.env.Schema, Group: "bench", Logger: quiet()})
	require.NoError(b, err)
	h := el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, _ := middleware.TxFromContext(ctx)
		e, _ := middleware.EventFromContext(ctx)
		return nil, be.business(ctx, tx, e)
	})
	ctx := context.Background()
	var workers, done atomic.Int64
	b.SetParallelism(benchParallelism)
	b.ResetTimer()
	meter := cpuMeter(b, be.pool)
	b.RunParallel(func(pb *testing.PB) {
		next := benchEvents(workers.Add(1))
		for more := true; more; {
			batch := delivery.NewBatch()
			var msgs []*message.Message
			for len(msgs) < benchBatch {
				if more = pb.Next(); !more {
					break
				}
				msg, err := eventline.Encode(next())
				if err != nil {
					b.Error(err)
					return
				}
				msg.SetContext(batch.Add(ctx))
				msgs = append(msgs, msg)
			}
			if len(msgs) == 0 {
				return
			}
			errs := make(chan error, len(msgs))
			for i, msg := range msgs {
				go func() {
					_, err := h(msg)
					batch.Leave(i)
					errs <- err
				}()
			}
			batch.Seal()
			batch.Run(ctx)
			for range msgs {
				if err := <-errs; err != nil {
					b.Error(err)
					return
				}
			}
			done.Add(int64(len(msgs)))
		}
	})
	b.StopTimer()
	meter(done.Load())
	b.ReportMetric(float64(done.Load())/b.Elapsed().Seconds(), "events/s")
	require.Equal(b, 0, pgtest.Count(b, be.env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(be.env.Schema, "parked_events")))
}
