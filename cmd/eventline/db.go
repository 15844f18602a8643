package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/pgerr"
)

// connectTimeout bounds the first connection to PostgreSQL.
const connectTimeout = 10 * time.Second

// poolConfig parses the database URL; a malformed one is a usage error.
func poolConfig(ctx context.Context) (*pgxpool.Config, error) {
	inv := invocationOf(ctx)
	cfg, err := pgxpool.ParseConfig(inv.globals.databaseURL)
	if err != nil {
		return nil, usageErrorf(inv.path, "-database-url (or %s) is not a valid PostgreSQL URL: %v", envDatabaseURL, err)
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "eventline " + inv.path
	}
	return cfg, nil
}

// openPool connects to PostgreSQL with at least minConns connections
// allowed (more if the URL's pool_max_conns says so) and checks that the
// server answers.
func openPool(ctx context.Context, minConns int32) (*pgxpool.Pool, error) {
	cfg, err := poolConfig(ctx)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = max(cfg.MaxConns, minConns)
	return connectPool(ctx, cfg)
}

// connectPool opens a pool and pings the server.
func connectPool(ctx context.Context, cfg *pgxpool.Config) (*pgxpool.Pool, error) {
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, connectError(ctx, err)
	}
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, connectError(ctx, err)
	}
	return pool, nil
}

// connectOnce opens a single connection, for commands that need only one.
func connectOnce(ctx context.Context) (*pgx.Conn, error) {
	cfg, err := poolConfig(ctx)
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(cctx, cfg.ConnConfig)
	if err != nil {
		return nil, connectError(ctx, err)
	}
	return conn, nil
}

func connectError(ctx context.Context, err error) error {
	return fmt.Errorf("cannot connect to PostgreSQL at %s: %w; check -database-url (or %s) and that the server is running",
		redactURL(globalsOf(ctx).databaseURL), err, envDatabaseURL)
}

// dbWait is waitForDatabase's schedule: 500ms, doubling, at most 30s.
var dbWait = eventline.Backoff{Initial: 500 * time.Millisecond, Multiplier: 2, Max: 30 * time.Second}

// waitForDatabase runs try until it succeeds, fails for another reason
// than PostgreSQL being unavailable (refused, reset, not answering:
// pgerr.Unavailable), or ctx ends. While the database is unavailable it
// logs a warning naming what waits (before) and backs off. It returns
// try's last error, or nil when ctx ended first: the caller checks ctx.
// Long-running commands use it so that one started during a database
// restart or failover starts when the database answers, while a wrong URL,
// password or schema still fails at once.
func waitForDatabase(ctx context.Context, before string, try func() error) error {
	return backoff.Retry(ctx, dbWait, pgerr.Unavailable, func(wait time.Duration, err error) {
		logger(ctx).Warn("PostgreSQL is unavailable; waiting for it before "+before,
			"database", redactURL(globalsOf(ctx).databaseURL), "retry_in", wait, "err", err)
	}, try)
}
