// Package setup is the plumbing the examples share and that is not what they
// are about: connecting to PostgreSQL and (re)creating the example's schema,
// starting the in-process Kafka (or using the cluster in KAFKA_BROKERS),
// both at once with Start, creating and deleting topics, and reading
// Prometheus counters back. Everything eventline-specific stays in
// the examples' main.go, where a reader can copy it from.
package setup

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// DefaultDatabaseURL is used when DATABASE_URL is not set.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// DatabaseURL returns DATABASE_URL, or DefaultDatabaseURL.
func DatabaseURL() string {
	if v := os.Getenv("DATABASE_URL"); v != "" {
		return v
	}
	return DefaultDatabaseURL
}

// AppName is the application_name of an example's connections: "eventline:"
// and the example's schema, so they can be found in pg_stat_activity (the
// examples' tests check that none is left behind).
func AppName(schema string) string { return "eventline:" + schema }

// Pool opens a connection pool of at most maxConns connections, named
// appName in pg_stat_activity; configure, if any, may change the pool's
// configuration further before it opens.
func Pool(ctx context.Context, url, appName string, maxConns int32, configure ...func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	for _, f := range configure {
		f(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to PostgreSQL at %s (is it running? set DATABASE_URL): %w", redact(url), err)
	}
	return pool, nil
}

// ResetSchema drops schema with everything in it, applies eventline's
// migrations to it with the given number of outbox shards, and then runs
// ddl (the example's own business tables) with search_path set to it. An
// example that starts with ResetSchema can be run again and again.
func ResetSchema(ctx context.Context, pool *pgxpool.Pool, schema string, shards int, ddl ...string) error {
	if err := sqlident.Validate("schema", schema); err != nil {
		return err
	}
	if err := DropSchema(ctx, pool, schema); err != nil {
		return fmt.Errorf("drop schema %s: %w", schema, err)
	}
	if err := migrations.Up(ctx, pool, migrations.Config{Schema: schema, Shards: shards}); err != nil {
		return fmt.Errorf("migrate schema %s: %w", schema, err)
	}
	if len(ddl) == 0 {
		return nil
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+sqlident.Quote(schema)); err != nil {
		return err
	}
	for _, stmt := range ddl {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("create the example's tables: %w", err)
		}
	}
	return tx.Commit(ctx)
}

// DropSchema drops schema and everything in it.
func DropSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	_, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+sqlident.Quote(schema)+` CASCADE`)
	return err
}

// Env is what a story runs on: its Kafka cluster, and its schema, created
// afresh in PostgreSQL with eventline's tables and the story's own, with a
// pool on it. Close undoes all of it.
type Env struct {
	// Kafka is the cluster, from StartKafka.
	Kafka *Kafka
	// DB is the pool the schema was created with.
	DB *pgxpool.Pool
	// Log is the configuration's Logger, or one that discards everything.
	Log *slog.Logger

	c     Common
	pools []*pgxpool.Pool
}

// Start starts the Kafka cluster of c (StartKafka), opens a pool of
// maxConns connections named after c.Schema (AppName), and resets the
// schema with the given outbox shards and business tables (ResetSchema).
func Start(ctx context.Context, c Common, maxConns int32, shards int, ddl ...string) (_ *Env, err error) {
	e := &Env{Log: c.Logger, c: c}
	if e.Log == nil {
		e.Log = Logger(nil, slog.LevelError)
	}
	if e.Kafka, err = StartKafka(c.Brokers); err != nil {
		return nil, err
	}
	if e.DB, err = Pool(ctx, c.DatabaseURL, AppName(c.Schema), maxConns); err != nil {
		e.Kafka.Close()
		return nil, err
	}
	if err := ResetSchema(ctx, e.DB, c.Schema, shards, ddl...); err != nil {
		e.DB.Close()
		e.Kafka.Close()
		return nil, err
	}
	return e, nil
}

// Pool opens another pool of maxConns connections named after the schema;
// Close closes it.
func (e *Env) Pool(ctx context.Context, maxConns int32) (*pgxpool.Pool, error) {
	pool, err := Pool(ctx, e.c.DatabaseURL, AppName(e.c.Schema), maxConns)
	if err != nil {
		return nil, err
	}
	e.pools = append(e.pools, pool)
	return pool, nil
}

// Close closes the pools opened with Pool, drops the schema unless Keep is
// set, closes DB and stops Kafka. It runs even when ctx has ended.
func (e *Env) Close(ctx context.Context) error {
	for i := len(e.pools) - 1; i >= 0; i-- {
		e.pools[i].Close()
	}
	var err error
	if !e.c.Keep {
		err = DropSchema(context.WithoutCancel(ctx), e.DB, e.c.Schema)
	}
	e.DB.Close()
	e.Kafka.Close()
	return err
}

// Logger returns a text logger writing to w at level and above; nil w
// discards everything.
func Logger(w io.Writer, level slog.Level) *slog.Logger {
	if w == nil {
		w = io.Discard
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
}

// Counter sums the samples of a counter or gauge read from g, over every
// series whose labels include the given ones (a nil map matches all).
func Counter(g prometheus.Gatherer, name string, labels map[string]string) float64 {
	sum, _ := metrictest.Value(g, name, labels)
	return sum
}

// WaitFor polls cond every 20ms until it returns true, returns an error, or
// timeout passes; what names the condition in the timeout error.
func WaitFor(ctx context.Context, timeout time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("stopped waiting for %s: %w", what, context.Cause(ctx))
		case <-deadline.C:
			return fmt.Errorf("timed out after %s waiting for %s", timeout, what)
		case <-tick.C:
		}
	}
}

func redact(url string) string {
	if i := strings.Index(url, "@"); i >= 0 {
		if j := strings.Index(url, "://"); j >= 0 && j < i {
			return url[:j+3] + "…" + url[i:]
		}
	}
	return url
}

// Common is the configuration every example shares; each example's config
// embeds it.
type Common struct {
	// DatabaseURL is the PostgreSQL to run against.
	DatabaseURL string
	// Brokers is the Kafka cluster; empty starts one in-process (kfake).
	Brokers []string
	// Schema is dropped and recreated at start, and dropped at the end
	// unless Keep is set.
	Schema string
	Keep   bool
	// Logger receives eventline's and Watermill's logs.
	Logger *slog.Logger
}

// Main registers the shared flags (-schema, -keep, -log-level), parses the
// command line (register the example's own flags first), fills c from them
// and from the environment (the database and the brokers), and runs fn until
// it returns or SIGINT/SIGTERM cancels its context. It exits 2 on a usage
// error and 1 when fn fails, prefixing the message with name.
func Main(name, defaultSchema string, c *Common, fn func(ctx context.Context) error) {
	*c = Common{DatabaseURL: DatabaseURL(), Brokers: BrokersFromEnv()}
	flag.StringVar(&c.Schema, "schema", defaultSchema, "PostgreSQL schema the example (re)creates")
	flag.BoolVar(&c.Keep, "keep", false, "keep the schema after the run, to look at the tables")
	level := flag.String("log-level", "warn", "log level on stderr: debug, info, warn or error")
	flag.Parse()
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		fmt.Fprintf(os.Stderr, "%s: log level %q: use debug, info, warn or error\n", name, *level)
		os.Exit(2)
	}
	c.Logger = Logger(os.Stderr, lvl)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := fn(ctx); err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		stop()
		os.Exit(1)
	}
}
