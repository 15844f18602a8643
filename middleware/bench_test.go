package middleware_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/pgtest"
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
	env         consumertest.Env
	pool        *pgxpool.Pool // the pool the benchmark works through
	insert      string
	traceParent string // of every event, when set
}

func newBenchEnv(b testing.TB) benchEnv {
	b.Helper()
	env := consumertest.New(b, pgtest.Options{MaxConns: 16})
	table := env.CreateTable(b, "bench_effects",
		`id bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL, payload jsonb NOT NULL`)
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
		addr := latencyProxy(b, fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port), d)
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

// eventline returns the middleware of the group "bench", traced through
// tp (nil: off), around the business insert.
func (be benchEnv) eventline(b testing.TB, tp trace.TracerProvider) (*middleware.Eventline, message.HandlerFunc) {
	el, err := middleware.New(be.pool, middleware.Config{Schema: be.env.Schema, Group: "bench", Logger: quiet(), TracerProvider: tp})
	require.NoError(b, err)
	return el, el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, _ := middleware.TxFromContext(ctx)
		e, _ := middleware.EventFromContext(ctx)
		return nil, be.business(ctx, tx, e)
	})
}

// run applies b.N events with apply, n at a time (the last call of a
// goroutine may get fewer), on benchParallelism × GOMAXPROCS goroutines,
// each over its own aggregates, and reports events/s and CPU per event.
// The events carry be.traceParent.
func (be benchEnv) run(b *testing.B, n int, apply func(msgs []*message.Message) error) {
	var workers, done atomic.Int64
	b.SetParallelism(benchParallelism)
	b.ResetTimer()
	meter := cpuMeter(b, be.pool)
	b.RunParallel(func(pb *testing.PB) {
		next := benchEvents(workers.Add(1))
		var msgs []*message.Message
		for more := true; more; {
			msgs = msgs[:0]
			for len(msgs) < n {
				if more = pb.Next(); !more {
					break
				}
				e := next()
				e.TraceParent = be.traceParent
				msg, err := eventline.Encode(e)
				if err != nil {
					b.Error(err)
					return
				}
				msgs = append(msgs, msg)
			}
			if len(msgs) == 0 {
				return
			}
			if err := apply(msgs); err != nil {
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

// bare applies msgs in one transaction of their own, as a handler without
// eventline would.
func (be benchEnv) bare(msgs []*message.Message) error {
	ctx := context.Background()
	return pgx.BeginFunc(ctx, be.pool, func(tx pgx.Tx) error {
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
}

func BenchmarkBareHandler(b *testing.B) {
	be := newBenchEnv(b)
	be.run(b, 1, be.bare)
}

func BenchmarkMiddleware(b *testing.B) {
	be := newBenchEnv(b)
	_, h := be.eventline(b, nil)
	be.run(b, 1, func(msgs []*message.Message) error {
		_, err := h(msgs[0])
		return err
	})
	require.Equal(b, 0, be.env.Count(b, "parked_events", ""))
}

// benchBatch is the batch size of the batch benchmarks.
const benchBatch = 16

// BenchmarkBareBatch is BenchmarkBareHandler applying benchBatch events per
// transaction: the baseline for BenchmarkBatchMiddleware.
func BenchmarkBareBatch(b *testing.B) {
	be := newBenchEnv(b)
	be.run(b, benchBatch, be.bare)
}

// BenchmarkBatchMiddleware applies benchBatch events per transaction
// through the composed middleware (one batch), each member on its
// own goroutine as a Router runs them.
func BenchmarkBatchMiddleware(b *testing.B) {
	be := newBenchEnv(b)
	_, h := be.eventline(b, nil)
	ctx := context.Background()
	be.run(b, benchBatch, func(msgs []*message.Message) error {
		batch := delivery.NewBatch()
		errs := make(chan error, len(msgs))
		for _, msg := range msgs {
			msg.SetContext(batch.Add(ctx))
		}
		for i, msg := range msgs {
			go func() {
				_, err := h(msg)
				batch.Leave(i)
				errs <- err
			}()
		}
		batch.Seal()
		batch.Run(ctx)
		var err error
		for range msgs {
			err = cmp.Or(err, <-errs)
		}
		return err
	})
	require.Equal(b, 0, be.env.Count(b, "parked_events", ""))
}

// The tracing benchmarks measure what tracing costs the consumer, off (no
// TracerProvider: the default) and on (the OTel SDK sampling every span,
// batching them to an exporter that drops them):
//
//	go test -run '^$' -bench 'BenchmarkTracing' -benchmem -benchtime 3s ./middleware/
//
// BenchmarkTracingMiddleware is BenchmarkMiddleware (a transaction and a
// business insert per event, on PostgreSQL) behind Traced, as Chain and
// the consumer compose it; BenchmarkTracingWrapper is the tracing alone,
// around a handler that does nothing, where its cost is not hidden by the
// database's.

// benchTraceparent is the context the relay's send span writes into each
// record.
const benchTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func benchProviders(b *testing.B) map[string]trace.TracerProvider {
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(tracetest.NewNoopExporter()), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return map[string]trace.TracerProvider{"off": nil, "sdk": tp}
}

func BenchmarkTracingMiddleware(b *testing.B) {
	for _, mode := range []string{"off", "sdk"} {
		b.Run(mode, func(b *testing.B) {
			be := newBenchEnv(b)
			be.traceParent = benchTraceparent
			el, mw := be.eventline(b, benchProviders(b)[mode])
			h := el.Traced(mw)
			b.ReportAllocs()
			be.run(b, 1, func(msgs []*message.Message) error {
				_, err := h(msgs[0])
				return err
			})
		})
	}
}

func BenchmarkTracingWrapper(b *testing.B) {
	for _, mode := range []string{"off", "sdk"} {
		b.Run(mode, func(b *testing.B) {
			be := newBenchEnv(b)
			el, _ := be.eventline(b, benchProviders(b)[mode])
			h := el.Traced(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			e := benchEvents(1)()
			e.TraceParent = benchTraceparent
			msg, err := eventline.Encode(e)
			require.NoError(b, err)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := h(msg); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// benchAppName names the benchmark pools' connections, so cpuMeter finds
// their server processes.
var benchAppName = func() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return "eventline-bench-" + hex.EncodeToString(b[:])
}()

// cpuMeter reports CPU time per event of the benchmark process (go-µs/ev)
// and of the PostgreSQL backends serving pool (pg-µs/ev, when PostgreSQL
// runs on this host): on a shared machine, CPU per event varies much less
// with the load than events per second.
func cpuMeter(b *testing.B, pool *pgxpool.Pool) func(events int64) {
	pg0, self0 := backendTicks(pool), selfCPU()
	return func(events int64) {
		if events == 0 {
			return
		}
		var ticks int64
		for pid, t := range backendTicks(pool) {
			ticks += t - pg0[pid]
		}
		b.ReportMetric(float64(ticks)*1e6/clockTicks/float64(events), "pg-µs/ev")
		b.ReportMetric(float64(selfCPU()-self0)/1e3/float64(events), "go-µs/ev")
	}
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat times (100 on Linux).
const clockTicks = 100

// backendTicks returns the CPU time, in clock ticks, of each server process
// with the benchmark's application name.
func backendTicks(pool *pgxpool.Pool) map[int]int64 {
	rows, err := pool.Query(context.Background(), `SELECT pid FROM pg_stat_activity WHERE application_name = $1`, benchAppName)
	if err != nil {
		return nil
	}
	defer rows.Close()
	out := map[int]int64{}
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) == nil {
			out[pid] = procTicks(pid)
		}
	}
	return out
}

func procTicks(pid int) int64 {
	st, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	s := string(st)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	k, _ := strconv.ParseInt(f[12], 10, 64)
	return u + k
}

func selfCPU() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}
