package bench

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Cost is what one stage of one variant asked of PostgreSQL over a
// measured window: the figures behind "round trips per event", the cost
// metric later optimisation work is judged by.
type Cost struct {
	// Stage is producer, relay, consumer, or pipeline (all three).
	Stage string
	// Variant names the design and, where it matters, the setting.
	Variant string
	// Rate is the stage's throughput in the scenario's unit (events/s;
	// tx/s for the producer), 0 when the scenario offers a fixed rate.
	Rate float64
	// Events is what the figures are divided by.
	Events int64
	// RoundTrips and Statements are counted by a pgx tracer on the stage's
	// own pool(s) (see queryCounter); Connects apart.
	RoundTrips, Statements, Connects int64
	// Rows is n_tup_ins + n_tup_upd + n_tup_del over the variant's schemas
	// (pg_stat_user_tables), WALBytes the WAL written (see costSource).
	// Both are read only for a stage that has its schemas to itself
	// (Server).
	Rows, WALBytes int64
	Server         bool
	// GoCPU is this process's CPU time over the window, PGCPU the local
	// PostgreSQL server's (see serverCPUBetween). Like Rows, read only for
	// a stage that has the window to itself; PGCPU only when the server
	// runs on this machine.
	GoCPU, PGCPU     time.Duration
	GoCPUOK, PGCPUOK bool
}

func perEvent(v, n int64) float64 {
	if n <= 0 {
		return 0
	}
	return float64(v) / float64(n)
}

// perEventMicros is d ÷ n in whole microseconds.
func perEventMicros(d time.Duration, n int64) string {
	return fmt.Sprintf("%.0f", perEvent(d.Microseconds(), n))
}

// RoundTripsPerEvent is RoundTrips ÷ Events.
func (c Cost) RoundTripsPerEvent() float64 { return perEvent(c.RoundTrips, c.Events) }

// StatementsPerEvent is Statements ÷ Events.
func (c Cost) StatementsPerEvent() float64 { return perEvent(c.Statements, c.Events) }

// add sums two measurements of the same stage and variant.
func (c Cost) add(o Cost) Cost {
	if c.Stage == "" {
		return o
	}
	c.Events += o.Events
	c.RoundTrips += o.RoundTrips
	c.Statements += o.Statements
	c.Connects += o.Connects
	c.Rows += o.Rows
	c.WALBytes += o.WALBytes
	c.Server = c.Server && o.Server
	c.GoCPU += o.GoCPU
	c.PGCPU += o.PGCPU
	c.GoCPUOK = c.GoCPUOK && o.GoCPUOK
	c.PGCPUOK = c.PGCPUOK && o.PGCPUOK
	return c
}

// serverStats is how this PostgreSQL can tell rows and WAL per variant.
type serverStats struct {
	// pgss is the qualified pg_stat_statements view when the server has
	// the module loaded (shared_preload_libraries) and the extension is
	// created in this database; "" otherwise, and why says why.
	pgss string
	why  string
	// forceFlush is true from PostgreSQL 15, whose backends keep their
	// table counters for up to a second (ten when idle) unless asked to
	// flush them with pg_stat_force_next_flush().
	forceFlush bool
}

// detectServerStats finds out whether pg_stat_statements can be used.
func detectServerStats(ctx context.Context, db *pgxpool.Pool) serverStats {
	var s serverStats
	var version int
	var preload string
	var ns *string
	err := db.QueryRow(ctx, `SELECT current_setting('server_version_num')::int,
			coalesce(current_setting('shared_preload_libraries', true), ''),
			(SELECT n.nspname::text FROM pg_extension x JOIN pg_namespace n ON n.oid = x.extnamespace WHERE x.extname = 'pg_stat_statements')`).
		Scan(&version, &preload, &ns)
	if err != nil {
		s.why = fmt.Sprintf("cannot read the server's settings (%v)", err)
		return s
	}
	s.forceFlush = version >= 150000
	loaded := false
	for _, lib := range strings.Split(preload, ",") {
		if strings.Trim(strings.TrimSpace(lib), `"`) == "pg_stat_statements" {
			loaded = true
		}
	}
	switch {
	case !loaded:
		s.why = "pg_stat_statements is not in shared_preload_libraries"
		return s
	case ns == nil:
		s.why = "pg_stat_statements is loaded but not created in this database (CREATE EXTENSION pg_stat_statements)"
		return s
	}
	view := pgx.Identifier{*ns}.Sanitize() + ".pg_stat_statements"
	var n int64
	if err := db.QueryRow(ctx, `SELECT coalesce(sum(wal_bytes), 0)::bigint FROM `+view+` WHERE false`).Scan(&n); err != nil {
		s.why = fmt.Sprintf("pg_stat_statements cannot be read (%v)", err)
		return s
	}
	s.pgss = view
	return s
}

// describe says where rows and WAL bytes come from.
func (s serverStats) describe() string {
	rows := "rows = n_tup_ins + n_tup_upd + n_tup_del of the variant's own schemas (pg_stat_user_tables; every connection flushed with pg_stat_force_next_flush() before each reading)"
	if !s.forceFlush {
		rows = "rows = n_tup_ins + n_tup_upd + n_tup_del of the variant's own schemas (pg_stat_user_tables; before PostgreSQL 15 a backend may report them up to a second late)"
	}
	if s.pgss != "" {
		return rows + "; WAL = wal_bytes of the statements that name the variant's schemas in " + s.pgss + " (their commits' WAL records are under COMMIT, which names none, so not counted)"
	}
	return rows + "; WAL = pg_current_wal_lsn() difference over the window: the whole cluster's WAL, other sessions' included (" + s.why + ")"
}

// serverSnap is one reading of the server's counters for some schemas.
type serverSnap struct{ rows, wal int64 }

// flushStats has every idle connection of pools report its table
// counters now. It goes around pgx (PgConn), so no tracer counts it.
func (e *env) flushStats(ctx context.Context, pools ...*pgxpool.Pool) {
	if !e.server.forceFlush {
		return
	}
	for _, p := range append(pools, e.admin) {
		for _, c := range p.AcquireAllIdle(ctx) {
			_, _ = c.Conn().PgConn().Exec(ctx, `SELECT pg_stat_force_next_flush()`).ReadAll()
			c.Release()
		}
	}
}

// readServer reads rows written in schemas and the WAL position (or the
// WAL attributed to schemas' statements).
func (e *env) readServer(ctx context.Context, schemas []string) (serverSnap, error) {
	var s serverSnap
	if err := e.admin.QueryRow(ctx, `SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint
		FROM pg_stat_user_tables WHERE schemaname = ANY($1)`, schemas).Scan(&s.rows); err != nil {
		return s, fmt.Errorf("read pg_stat_user_tables: %w", err)
	}
	if e.server.pgss != "" {
		like := make([]string, len(schemas))
		for i, sc := range schemas {
			like[i] = "%" + sc + "%"
		}
		err := e.admin.QueryRow(ctx, `SELECT coalesce(sum(wal_bytes), 0)::bigint FROM `+e.server.pgss+`
			WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND query LIKE ANY($1)`, like).Scan(&s.wal)
		if err != nil {
			return s, fmt.Errorf("read pg_stat_statements: %w", err)
		}
		return s, nil
	}
	if err := e.admin.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint`).Scan(&s.wal); err != nil {
		return s, fmt.Errorf("read pg_current_wal_lsn(): %w", err)
	}
	return s, nil
}

// meter measures one stage's cost over a window.
type meter struct {
	e              *env
	stage, variant string
	schemas        []string
	pools          []*pgxpool.Pool
	counters       []*queryCounter
	c0             clientCount
	s0             serverSnap
	cpu0           costCPU
}

// startMeter starts a window. pools are flushed before each server
// reading; counters are the stage's tracers. Without schemas only the
// client side is measured: a stage that shares its schemas with others,
// and its window too, so neither the cluster's WAL nor the CPU used in it
// is the stage's. With schemas the stage must run alone.
func (e *env) startMeter(ctx context.Context, stage, variant string, schemas []string, pools []*pgxpool.Pool, counters ...*queryCounter) (*meter, error) {
	m := &meter{e: e, stage: stage, variant: variant, schemas: schemas, pools: pools, counters: counters}
	if len(schemas) > 0 {
		e.flushStats(ctx, pools...)
		s, err := e.readServer(ctx, schemas)
		if err != nil {
			return nil, err
		}
		m.s0 = s
		m.cpu0 = e.readCostCPU()
	}
	m.c0 = countAll(counters)
	return m, nil
}

// stop ends the window; events and rate are the stage's over it.
func (m *meter) stop(ctx context.Context, events int64, rate float64) (Cost, error) {
	c := countAll(m.counters).sub(m.c0)
	cost := Cost{Stage: m.stage, Variant: m.variant, Rate: rate, Events: events,
		RoundTrips: c.roundTrips(), Statements: c.statements(), Connects: c.connects}
	if len(m.schemas) > 0 {
		cpu := m.e.readCostCPU()
		cost.GoCPU, cost.GoCPUOK = cpu.self-m.cpu0.self, cpu.selfOK && m.cpu0.selfOK
		cost.PGCPU, cost.PGCPUOK = serverCPUBetween(m.cpu0.server, cpu.server), cpu.serverOK && m.cpu0.serverOK
		m.e.flushStats(ctx, m.pools...)
		s, err := m.e.readServer(ctx, m.schemas)
		if err != nil {
			return cost, err
		}
		cost.Rows, cost.WALBytes, cost.Server = s.rows-m.s0.rows, s.wal-m.s0.wal, true
	}
	return cost, nil
}

// logCost writes one progress line for c.
func (e *env) logCost(c Cost) {
	server := ""
	if c.Server {
		server = fmt.Sprintf(", %.2f rows/ev, %.0f WAL B/ev", perEvent(c.Rows, c.Events), perEvent(c.WALBytes, c.Events))
	}
	if c.GoCPUOK {
		server += ", Go " + perEventMicros(c.GoCPU, c.Events) + " µs/ev"
	}
	if c.PGCPUOK {
		server += ", PG " + perEventMicros(c.PGCPU, c.Events) + " µs/ev"
	}
	e.progressf("      cost %s %s: %d events, %.2f round trips/ev, %.2f statements/ev%s, %d connects", c.Stage, c.Variant, c.Events, c.RoundTripsPerEvent(), c.StatementsPerEvent(), server, c.Connects)
}

// txBeginner is a pool or one of its connections.
type txBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// warmPool opens a pool with tracer (may be nil) and connects all its
// connections before the clock starts: a component in production runs on
// a warm pool, and on a loaded machine opening 16 connections at once
// takes long enough to hide what is measured.
func (e *env) warmPool(ctx context.Context, conns int32, tracer *queryCounter) (*pgxpool.Pool, error) {
	pool, err := e.openPool(ctx, conns, tracer)
	if err != nil {
		return nil, err
	}
	if err := onEveryConn(ctx, pool, nil); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// onEveryConn acquires every connection the pool may open, holding them
// all so each is a different one, and runs fn (when set) on each of them
// concurrently: after it every connection is open and has run fn's
// statements, so pgx has prepared them there.
func onEveryConn(ctx context.Context, pool *pgxpool.Pool, fn func(ctx context.Context, c *pgxpool.Conn) error) error {
	n := int(pool.Config().MaxConns)
	held := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	actx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for range n {
		c, err := pool.Acquire(actx)
		if err != nil {
			return fmt.Errorf("warm the pool (%d connections): %w", n, err)
		}
		held = append(held, c)
	}
	if fn == nil {
		return nil
	}
	errc := make(chan error, n)
	for _, c := range held {
		go func() { errc <- fn(ctx, c) }()
	}
	var errs []error
	for range held {
		errs = append(errs, <-errc)
	}
	return errors.Join(errs...)
}
