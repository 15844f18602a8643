// Package pgtest gives each test its own PostgreSQL schema with eventline's
// migrations applied, on the real database named by TEST_DATABASE_URL.
package pgtest

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// DefaultURL is used when neither TEST_DATABASE_URL nor DATABASE_URL is set.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// URL returns the test database URL.
func URL() string {
	for _, k := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return DefaultURL
}

// Addr returns the host:port of the test database (for a fault proxy in
// front of it).
func Addr() string {
	cfg, err := pgconn.ParseConfig(URL())
	if err != nil || cfg.Host == "" || strings.HasPrefix(cfg.Host, "/") {
		return "127.0.0.1:5432"
	}
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
}

// URLVia returns the test database URL with its host and port replaced by
// addr (host:port), e.g. a faultproxy.Proxy's address.
func URLVia(addr string) string {
	u, err := url.Parse(URL())
	if err != nil {
		return URL()
	}
	u.Host = addr
	return u.String()
}

// Env is one test's isolated database environment.
type Env struct {
	Pool   *pgxpool.Pool
	Schema string
	Shards int
}

// Options tune New.
type Options struct {
	Shards   int   // outbox shards; defaults to 4
	MaxConns int32 // pool size; defaults to 8
}

var unsafeChars = regexp.MustCompile(`[^a-z0-9_]+`)

// NewSchemaName returns a unique schema name derived from the test name.
func NewSchemaName(t testing.TB) string {
	name := strings.ToLower(t.Name())
	name = unsafeChars.ReplaceAllString(name, "_")
	if len(name) > 40 {
		name = name[len(name)-40:]
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return "t_" + strings.Trim(name, "_") + "_" + hex.EncodeToString(b[:])
}

// New creates a fresh schema, applies the migrations to it, and drops it
// when the test ends.
func New(t testing.TB, opts Options) Env {
	t.Helper()
	opts.Shards = cmp.Or(opts.Shards, 4)
	opts.MaxConns = cmp.Or(opts.MaxConns, 8)
	pool := Pool(t, opts.MaxConns)
	schema := NewSchemaName(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, migrations.Up(ctx, pool, migrations.Config{Schema: schema, Shards: opts.Shards}))
	t.Cleanup(func() { DropSchema(t, schema) })
	return Env{Pool: pool, Schema: schema, Shards: opts.Shards}
}

// Pool opens a pool on the test database, closed when the test ends.
func Pool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	require.NoError(t, err)
	cfg.MaxConns = maxConns
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	require.NoError(t, pool.Ping(ctx), "PostgreSQL must be reachable at %s (run `make test`, which starts it)", URL())
	t.Cleanup(pool.Close)
	return pool
}

// DropSchema drops a schema and everything in it, on its own connection.
func DropSchema(t testing.TB, schema string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, URL())
	if err != nil {
		t.Logf("drop schema %s: %v", schema, err)
		return
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+sqlident.Quote(schema)+` CASCADE`); err != nil {
		t.Logf("drop schema %s: %v", schema, err)
	}
}

// Count runs a count query and returns the result.
func Count(t testing.TB, pool *pgxpool.Pool, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), query, args...).Scan(&n), query)
	return n
}
