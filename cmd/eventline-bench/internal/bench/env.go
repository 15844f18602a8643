package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/migrations"
)

// quiet discards the logs of the components under test.
var quiet = slog.New(slog.DiscardHandler)

// env is what every scenario shares: the configuration, an admin pool for
// creating and dropping schemas, and the progress writer.
type env struct {
	cfg       Config
	sizes     Sizes
	admin     *pgxpool.Pool
	pgVersion string
	server    serverStats
	// postmaster is the local PostgreSQL server's pid, 0 when the server
	// is elsewhere (noServerCPU says why).
	postmaster  int
	noServerCPU string
	start       time.Time

	mu sync.Mutex // serializes progress lines
}

func newEnv(ctx context.Context, cfg Config) (*env, error) {
	e := &env{cfg: cfg, sizes: cfg.sizes(), start: time.Now()}
	pool, err := e.openPool(ctx, 4, nil)
	if err != nil {
		return nil, err
	}
	e.admin = pool
	if err := pool.QueryRow(ctx, `SHOW server_version`).Scan(&e.pgVersion); err != nil {
		pool.Close()
		return nil, fmt.Errorf("read PostgreSQL version: %w", err)
	}
	e.server = detectServerStats(ctx, pool)
	e.postmaster, e.noServerCPU = findPostmaster(ctx, pool)
	if cfg.ProfileDir != "" {
		if err := os.MkdirAll(cfg.ProfileDir, 0o755); err != nil {
			pool.Close()
			return nil, fmt.Errorf("profile directory: %w", err)
		}
		runtime.SetBlockProfileRate(int(10 * time.Microsecond))
		runtime.SetMutexProfileFraction(10)
	}
	return e, nil
}

func (e *env) close() {
	e.admin.Close()
	if e.cfg.ProfileDir != "" {
		runtime.SetBlockProfileRate(0)
		runtime.SetMutexProfileFraction(0)
	}
}

func gomaxprocs() int { return runtime.GOMAXPROCS(0) }

func (e *env) kafkaName() string {
	if len(e.cfg.Brokers) > 0 {
		return "brokers " + strings.Join(e.cfg.Brokers, ",")
	}
	return "kfake (in-process, over TCP)"
}

// progressf writes one progress line, prefixed with the time since start.
func (e *env) progressf(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	fmt.Fprintf(e.cfg.Progress, "[bench %6.1fs] %s\n", time.Since(e.start).Seconds(), fmt.Sprintf(format, args...))
}

// watch prints count() against total every two seconds until stopped.
func (e *env) watch(label string, total int, count func() int64) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(2 * time.Second)
		defer t.Stop()
		last, lastAt := count(), time.Now()
		for {
			select {
			case <-done:
				return
			case now := <-t.C:
				n := count()
				e.progressf("   %s: %d/%d (%.0f/s)", label, n, total, float64(n-last)/now.Sub(lastAt).Seconds())
				if n == last {
					if h := e.horizonHolder(); h != "" {
						e.progressf("   warning: no progress; %s", h)
					}
				}
				last, lastAt = n, now
			}
		}
	}()
	return func() { close(done); wg.Wait() }
}

// horizonHolder describes the oldest transaction holding an xid for more
// than two seconds, anywhere in the cluster, or returns "". Such a
// transaction holds back pg_snapshot_xmin, and with it every outbox reader
// that waits for it (watermill-sql's default schema, so eventline's relay
// and the plain forwarder).
func (e *env) horizonHolder() string {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var pid int
	var db, state, query string
	var age float64
	err := e.admin.QueryRow(ctx, `SELECT pid, coalesce(datname, ''), coalesce(state, ''),
			extract(epoch FROM now() - xact_start)::float8, left(coalesce(query, ''), 80)
		FROM pg_stat_activity
		WHERE backend_xid IS NOT NULL AND xact_start < now() - interval '2 seconds' AND pid <> pg_backend_pid()
		ORDER BY xact_start LIMIT 1`).Scan(&pid, &db, &state, &age, &query)
	if err != nil {
		return ""
	}
	return fmt.Sprintf("transaction of pid %d (database %s, %s for %.0fs: %s) holds the xmin horizon, which stalls xmin-ordered outbox readers",
		pid, db, state, age, strings.Join(strings.Fields(query), " "))
}

// openPool opens a pool on the benchmark database. tracer may be nil.
func (e *env) openPool(ctx context.Context, maxConns int32, tracer *queryCounter) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(e.cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	pcfg.MaxConns = maxConns
	if tracer != nil {
		pcfg.ConnConfig.Tracer = tracer
		pcfg.ShouldPing = tracer.shouldPing
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("open database pool: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("PostgreSQL must be reachable at %s (`make bench` starts it): %w", e.cfg.DatabaseURL, err)
	}
	return pool, nil
}

// qualify returns the quoted, schema-qualified name of a table.
func qualify(schema, table string) string { return pgx.Identifier{schema, table}.Sanitize() }

// newSchema creates an empty schema for one variant and returns it with a
// function that drops it. The prefixes are the harness's own constants;
// eventline's components check the name where they take it.
func (e *env) newSchema(ctx context.Context, prefix string) (string, func(), error) {
	var b [4]byte
	_, _ = rand.Read(b[:])
	schema := "bench_" + prefix + "_" + hex.EncodeToString(b[:])
	if _, err := e.admin.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{schema}.Sanitize()); err != nil {
		return "", nil, fmt.Errorf("create schema %s: %w", schema, err)
	}
	drop := func() {
		dctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := e.admin.Exec(dctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`); err != nil {
			e.progressf("   warning: drop schema %s: %v", schema, err)
		}
	}
	return schema, drop, nil
}

// newEventlineSchema creates a schema with eventline's migrations applied
// and the given number of outbox shards.
func (e *env) newEventlineSchema(ctx context.Context, prefix string, shards int) (string, func(), error) {
	schema, drop, err := e.newSchema(ctx, prefix)
	if err != nil {
		return "", nil, err
	}
	if err := migrations.Up(ctx, e.admin, migrations.Config{Schema: schema, Shards: shards}); err != nil {
		drop()
		return "", nil, fmt.Errorf("migrate %s: %w", schema, err)
	}
	return schema, drop, nil
}

// execer is a pool, a connection or a transaction.
type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// exec runs statements on the admin pool.
func (e *env) exec(ctx context.Context, stmts ...string) error {
	for _, s := range stmts {
		if _, err := e.admin.Exec(ctx, s); err != nil {
			return fmt.Errorf("%s: %w", firstLine(s), err)
		}
	}
	return nil
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return s
}

// waitFor polls count until it reaches target and returns when it did.
func waitFor(ctx context.Context, timeout time.Duration, target int64, count func() int64) (time.Time, error) {
	deadline := time.Now().Add(timeout)
	for {
		if count() >= target {
			return time.Now(), nil
		}
		if time.Now().After(deadline) {
			return time.Time{}, fmt.Errorf("%w: %d of %d after %s", errIncomplete, count(), target, timeout)
		}
		select {
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// profile starts a CPU profile for one measured phase when
// Config.ProfileDir is set; stop ends it and writes the block and mutex
// profiles accumulated so far.
func (e *env) profile(name string) (stop func()) {
	dir := e.cfg.ProfileDir
	if dir == "" {
		return func() {}
	}
	f, err := os.Create(filepath.Join(dir, name+".cpu.pprof"))
	if err != nil {
		e.progressf("   warning: CPU profile: %v", err)
		return func() {}
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		e.progressf("   warning: CPU profile: %v", err)
		_ = f.Close()
		return func() {}
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
		for _, kind := range []string{"block", "mutex"} {
			writeProfile(filepath.Join(dir, name+"."+kind+".pprof"), kind)
		}
	}
}

func writeProfile(path, kind string) {
	f, err := os.Create(path)
	if err != nil {
		return
	}
	defer f.Close()
	_ = pprof.Lookup(kind).WriteTo(f, 0)
}
