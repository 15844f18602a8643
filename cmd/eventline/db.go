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

// database names a PostgreSQL database for connecting to it and for the
// errors that say what to check.
type database struct {
	url string
	// what names it in a connection error: "PostgreSQL", "the outbox
	// database".
	what string
	// flag is where its URL came from: "-database-url (or DATABASE_URL)".
	flag string
}

// mainDB is the database -database-url names.
func (inv *invocation) mainDB() database {
	return database{url: inv.globals.databaseURL, what: "PostgreSQL", flag: "-database-url (or " + envDatabaseURL + ")"}
}

// poolConfig parses db's URL; a malformed one is a usage error.
func (inv *invocation) poolConfig(db database) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(db.url)
	if err != nil {
		return nil, usageErrorf("%s is not a valid PostgreSQL URL: %v", db.flag, err)
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "eventline " + inv.path
	}
	return cfg, nil
}

// pool connects to the -database-url database; see openPool.
func (inv *invocation) pool(ctx context.Context) (*pgxpool.Pool, error) {
	return inv.openPool(ctx, inv.mainDB(), 2)
}

// openPool connects to db with at least minConns connections allowed (more
// if the URL's pool_max_conns says so) and checks that the server answers.
// The pool is closed when the command returns.
func (inv *invocation) openPool(ctx context.Context, db database, minConns int32) (*pgxpool.Pool, error) {
	cfg, err := inv.poolConfig(db)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = max(cfg.MaxConns, minConns)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, connectError(db, err)
	}
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, connectError(db, err)
	}
	inv.pools = append(inv.pools, pool)
	return pool, nil
}

// closePools closes the pools the command opened.
func (inv *invocation) closePools() {
	for _, p := range inv.pools {
		p.Close()
	}
	inv.pools = nil
}

// connectOnce opens a single connection to -database-url, for a command
// that needs only one; the caller closes it.
func (inv *invocation) connectOnce(ctx context.Context) (*pgx.Conn, error) {
	db := inv.mainDB()
	cfg, err := inv.poolConfig(db)
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(cctx, cfg.ConnConfig)
	if err != nil {
		return nil, connectError(db, err)
	}
	return conn, nil
}

func connectError(db database, err error) error {
	return fmt.Errorf("cannot connect to %s at %s: %w; check %s and that the server is running",
		db.what, redactURL(db.url), err, db.flag)
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
func (inv *invocation) waitForDatabase(ctx context.Context, before string, try func() error) error {
	return backoff.Retry(ctx, dbWait, pgerr.Unavailable, func(wait time.Duration, err error) {
		inv.logger().Warn("PostgreSQL is unavailable; waiting for it before "+before,
			"database", redactURL(inv.globals.databaseURL), "retry_in", wait, "err", err)
	}, try)
}
