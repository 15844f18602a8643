package admin

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

// DBTX is the smallest database handle the functions that read, or write
// in one statement, need: *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy
// it, so they run on a pool or inside the caller's transaction (a
// repeatable-read one reads one snapshot).
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Beginner is the handle of the functions that run transactions of their
// own (RebasePositions, AdvanceSequences, ReplayHeld):
// *pgxpool.Pool and *pgx.Conn satisfy it, and so does pgx.Tx (each
// transaction is then a savepoint of the caller's).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// ErrPositionAhead describes a shard whose position or rows carry
// transaction ids this cluster has not handed out yet
// (ShardStatus.PositionAhead, PositionCheck.Ahead): the outbox was
// restored or replicated from another cluster, nothing on the shard is
// relayed, and RebasePositions repairs it. The relay's log and `eventline
// status` quote it.
var ErrPositionAhead = outbox.ErrPositionAhead

// ReadShardCount returns the number of outbox shards recorded in schema
// (what a relay's pool is sized by: producer.PoolSizeFor). A schema
// without an outbox is an error wrapping producer.ErrNotMigrated.
func ReadShardCount(ctx context.Context, db DBTX, schema string) (int, error) {
	if err := checkArgs("ReadShardCount", db, schema); err != nil {
		return 0, err
	}
	return outbox.ShardCount(ctx, db, schema)
}

// checkArgs refuses a nil handle and a schema that is not a plain SQL
// identifier, naming the function and the argument.
func checkArgs(fn string, db any, schema string) error {
	if err := checkDB(fn, "db", db); err != nil {
		return err
	}
	return sqlident.Validate("admin."+fn+": schema", schema)
}

// checkDB refuses a nil handle passed as arg to fn.
func checkDB(fn, arg string, db any) error {
	if outbox.NilHandle(db) {
		return fmt.Errorf("admin.%s: %s is nil: pass a *pgxpool.Pool (or a *pgx.Conn)", fn, arg)
	}
	return nil
}

// errDryRun rolls back a dry run's transaction.
var errDryRun = errors.New("dry run")
