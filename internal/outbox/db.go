package outbox

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/pgerr"
	"github.com/eventline/eventline/internal/sqlident"
)

// The outbox's own statements, shared by the producer, the relay and the
// admin package. Callers validate the schema at their public edge; these
// trust it.

// DBTX is the database handle the statements run on: *pgxpool.Pool,
// *pgx.Conn and pgx.Tx satisfy it.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	RowQuerier
}

// RowQuerier is the part of DBTX that reads one row.
type RowQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ErrNotMigrated is producer.ErrNotMigrated: the schema has no outbox, or
// lacks tables a later migration adds.
var ErrNotMigrated = errors.New("eventline: outbox schema is not migrated")

// ErrPositionAhead is admin.ErrPositionAhead: a shard's position or rows
// carry transaction ids this cluster has not handed out yet.
var ErrPositionAhead = errors.New("eventline: outbox position is ahead of this cluster's transaction ids (the outbox was restored or replicated from another cluster)")

// NilHandle reports whether a database handle given to a public function
// is nil: a nil interface, or one holding a nil *pgxpool.Pool, *pgx.Conn,
// *pgxpool.Conn or *pgxpool.Tx (which a plain == nil misses, and which
// would panic on first use).
func NilHandle(db any) bool {
	switch v := db.(type) {
	case nil:
		return true
	case *pgxpool.Pool:
		return v == nil
	case *pgx.Conn:
		return v == nil
	case *pgxpool.Conn:
		return v == nil
	case *pgxpool.Tx:
		return v == nil
	}
	return false
}

// SQL renders query for one shard of the outbox in schema: {messages} and
// {offsets} become the shard's tables (watermill-sql's names), {shard} its
// number, {schema} the quoted schema.
func SQL(schema string, shard int, query string) string {
	query = strings.NewReplacer(
		"{messages}", sqlident.Qualify(schema, Table(shard)),
		"{offsets}", sqlident.Qualify(schema, OffsetsTable(shard)),
		"{shard}", strconv.Itoa(shard),
	).Replace(query)
	return sqlident.SQL(schema, query)
}

// ShardCount returns the number of outbox shards recorded in schema, or an
// error wrapping ErrNotMigrated when schema has no outbox.
func ShardCount(ctx context.Context, db RowQuerier, schema string) (int, error) {
	var shards int
	err := db.QueryRow(ctx, sqlident.SQL(schema, `SELECT shards FROM {schema}.outbox_config`)).Scan(&shards)
	if err != nil {
		if pgerr.HasCode(err, pgerr.UndefinedTable, pgerr.InvalidSchemaName) || errors.Is(err, pgx.ErrNoRows) {
			return 0, fmt.Errorf("%w: schema %q has no outbox_config; run `eventline migrate up` or migrations.Up first", ErrNotMigrated, schema)
		}
		return 0, fmt.Errorf("read outbox shard count: %w", err)
	}
	return shards, nil
}

// CheckRelayTables returns an error wrapping ErrNotMigrated when a table
// the relay writes besides the outbox is missing: its leases
// (001_outbox) or held_events, where its dead letters go (003_held_events).
func CheckRelayTables(ctx context.Context, db RowQuerier, schema string) error {
	var ok bool
	err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL AND to_regclass($3) IS NOT NULL`,
		sqlident.Qualify(schema, "relay_leases"), sqlident.Qualify(schema, "relay_members"), sqlident.Qualify(schema, "held_events")).Scan(&ok)
	if err != nil {
		return fmt.Errorf("look for the relay's tables: %w", err)
	}
	if !ok {
		return fmt.Errorf("%w: schema %q lacks the relay's tables (relay_leases, held_events); run `eventline migrate up` or migrations.Up first", ErrNotMigrated, schema)
	}
	return nil
}

// FenceNamespace is the advisory-lock namespace of the shards' read fences
// (one lock per shard), derived from the schema so outboxes in different
// schemas of one database do not collide: a relay reading a shard holds it
// for its transaction, and RebasePositions takes it to keep relays out.
func FenceNamespace(schema string) int64 {
	h := fnv.New32a()
	_, _ = h.Write([]byte("eventline.relay:" + schema + ":fence"))
	return int64(h.Sum32() & 0x7fffffff)
}

// Position compares a shard's relay position and newest row with the
// cluster's transaction counter (admin.PositionCheck documents it).
type Position struct {
	Shard                        int
	Position, NewestRow, Counter uint64
}

// Ahead reports whether the position or a row carries a transaction id the
// cluster has not handed out.
func (p Position) Ahead() bool { return p.Position >= p.Counter || p.NewestRow >= p.Counter }

// positionSQL returns position, newest row and counter of one shard ($1
// the relay's consumer group).
const positionSQL = `SELECT COALESCE((SELECT last_processed_transaction_id::text FROM {offsets} WHERE consumer_group = $1), '0'),
	COALESCE((SELECT max(transaction_id)::text FROM {messages}), '0'),
	pg_snapshot_xmax(pg_current_snapshot())::text`

// CheckPosition reads shard's Position.
func CheckPosition(ctx context.Context, db RowQuerier, schema string, shard int) (Position, error) {
	p := Position{Shard: shard}
	var pos, newest, counter string
	if err := db.QueryRow(ctx, SQL(schema, shard, positionSQL), RelayConsumerGroup).Scan(&pos, &newest, &counter); err != nil {
		return p, fmt.Errorf("check shard %d position: %w", shard, err)
	}
	p.Position, _ = strconv.ParseUint(pos, 10, 64)
	p.NewestRow, _ = strconv.ParseUint(newest, 10, 64)
	p.Counter, _ = strconv.ParseUint(counter, 10, 64)
	return p, nil
}

// HorizonHolder is the oldest transaction holding a transaction id, the
// one holding PostgreSQL's xmin horizon (admin.HorizonHolder).
type HorizonHolder struct {
	// PID is its backend's process id (0 for a prepared transaction).
	PID int32
	// Xid is its transaction id; BackendXmin its snapshot's xmin, if any.
	Xid, BackendXmin string
	// XactAge is how long the transaction has been open.
	XactAge time.Duration
	// QueryStart is when its current or last statement started.
	QueryStart *time.Time
	// State is pg_stat_activity.state (e.g. "idle in transaction").
	State string
	// ApplicationName and Database say whose it is; Query is its current
	// or last statement, when the role reading it may see it.
	ApplicationName, Database, Query string
	// PreparedGID is set for a prepared (two-phase) transaction.
	PreparedGID string
}

// horizonHolderSQL finds the oldest transaction holding a transaction id,
// open or prepared, anywhere in the cluster.
const horizonHolderSQL = `SELECT pid, xid, xmin, age_s, query_start, state, app, db, query, gid FROM (
		SELECT pid, backend_xid::text AS xid, COALESCE(backend_xmin::text, '') AS xmin, age(backend_xid) AS xid_age,
			EXTRACT(EPOCH FROM clock_timestamp() - xact_start)::float8 AS age_s, query_start, COALESCE(state, '') AS state,
			COALESCE(application_name, '') AS app, COALESCE(datname, '') AS db, left(COALESCE(query, ''), 200) AS query, '' AS gid
		FROM pg_stat_activity WHERE backend_xid IS NOT NULL
		UNION ALL
		SELECT 0, transaction::text, '', age(transaction), EXTRACT(EPOCH FROM clock_timestamp() - prepared)::float8, NULL,
			'prepared', '', database, '', gid
		FROM pg_prepared_xacts
	) t ORDER BY xid_age DESC LIMIT 1`

// ReadHorizonHolder returns the oldest transaction holding a transaction
// id in the cluster, or nil when there is none.
func ReadHorizonHolder(ctx context.Context, db RowQuerier) (*HorizonHolder, error) {
	var h HorizonHolder
	var age float64
	err := db.QueryRow(ctx, horizonHolderSQL).Scan(&h.PID, &h.Xid, &h.BackendXmin, &age, &h.QueryStart, &h.State, &h.ApplicationName, &h.Database, &h.Query, &h.PreparedGID)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the transaction holding the xmin horizon: %w", err)
	}
	h.XactAge = time.Duration(max(age, 0) * float64(time.Second))
	return &h, nil
}

// cleanSQL deletes up to $2 rows of one shard written more than $1 seconds
// ago that every consumer group of the shard has acknowledged, oldest
// first.
const cleanSQL = `DELETE FROM {messages} WHERE (transaction_id, "offset") IN (
		SELECT m.transaction_id, m."offset" FROM {messages} m,
			(SELECT last_processed_transaction_id AS txid, offset_acked AS off FROM {offsets}
			 ORDER BY last_processed_transaction_id, offset_acked LIMIT 1) acked
		WHERE (m.transaction_id, m."offset") <= (acked.txid, acked.off)
		  AND m.created_at < LOCALTIMESTAMP - make_interval(secs => $1)
		ORDER BY m.transaction_id, m."offset"
		LIMIT $2)`

// Clean deletes the rows of shards older than retention that every
// consumer group of their shard has acknowledged, in batches of batchSize
// rows (each its own statement), waiting pause between batches. It returns
// what it deleted per shard, also when it fails part way.
func Clean(ctx context.Context, db DBTX, schema string, shards []int, retention time.Duration, batchSize int, pause time.Duration) (map[int]int64, error) {
	deleted := map[int]int64{}
	for _, shard := range shards {
		query := SQL(schema, shard, cleanSQL)
		deleted[shard] = 0
		for {
			tag, err := db.Exec(ctx, query, retention.Seconds(), batchSize)
			if err != nil {
				return deleted, fmt.Errorf("clean outbox shard %d: %w", shard, err)
			}
			n := tag.RowsAffected()
			deleted[shard] += n
			if n < int64(batchSize) {
				break
			}
			if pause > 0 {
				if err := backoff.Sleep(ctx, pause); err != nil {
					return deleted, err
				}
			}
		}
	}
	return deleted, nil
}
