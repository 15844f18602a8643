package producer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

// PublishAndCommit runs fn in a new transaction on db, then writes the
// events fn returns into the outbox and commits, sending the outbox
// statement and COMMIT to PostgreSQL together: one round trip fewer than
// fn's statements, PublishTx and Commit in a transaction of your own. It
// returns the events as written (see PublishTxReturning), or an error with
// nothing committed.
//
// db is the producer's *pgxpool.Pool, a *pgxpool.Conn or a *pgx.Conn; any
// other Begin-er (a pgx.Tx: fn then runs in a savepoint) works the same,
// but its outbox statement and its COMMIT travel separately.
//
// fn does the transaction's business work on tx and returns the events to
// publish (none: the transaction just commits). It must not commit or roll
// back tx itself (Commit and Rollback return an error); returning an error
// rolls the transaction back, and PublishAndCommit returns that error. fn
// may also call PublishTx on tx, for events whose writing it wants
// answered before it goes on.
//
// Events are checked like PublishTx's, after fn returned: an invalid
// event rolls the transaction back. Unlike PublishTx, whose conflicts
// leave the caller's transaction usable, a conflict here
// (*TopicConflictError, and for supplied versions *VersionConflictError or
// *VersionGapError) rolls the whole transaction back: retry it from the
// start, re-reading what it depends on. Events with supplied versions
// take PublishTx's statement and then COMMIT, two round trips; events
// without, or whose versions are all the caller's
// (Config.CallerVersionedTypes), take the one-round-trip path.
//
// As with any commit, an error from the COMMIT itself (the connection
// broke while it was on its way) leaves the outcome unknown: look for the
// business rows before retrying.
func (p *Producer) PublishAndCommit(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, fn func(tx pgx.Tx) ([]eventline.Event, error)) ([]eventline.Event, error) {
	if outbox.NilHandle(db) {
		return nil, errors.New("producer.PublishAndCommit: db is nil: pass the producer's *pgxpool.Pool (or a *pgxpool.Conn or *pgx.Conn)")
	}
	if fn == nil {
		return nil, errors.New("producer.PublishAndCommit: fn is nil")
	}
	var conn *pgx.Conn // the connection the transaction runs on, when its COMMIT can carry the outbox statement
	switch h := db.(type) {
	case *pgxpool.Pool:
		c, err := h.Acquire(ctx)
		if err != nil {
			return nil, err
		}
		// A connection left inside a transaction (a panic in fn, a broken
		// connection) is closed by the pool instead of reused.
		defer c.Release()
		conn = c.Conn()
	case *pgxpool.Conn:
		conn = h.Conn()
	case *pgx.Conn:
		conn = h
	}
	var tx pgx.Tx
	var err error
	if conn != nil {
		tx, err = conn.Begin(ctx)
	} else {
		tx, err = db.Begin(ctx)
	}
	if err != nil {
		return nil, err
	}
	done := false
	defer func() {
		if !done {
			rollback(ctx, tx)
		}
	}()
	events, err := fn(ownedTx{tx})
	if err != nil {
		return nil, err
	}
	if len(events) == 0 {
		done = true
		return nil, tx.Commit(ctx)
	}
	pl, err := p.prepare(ctx, events)
	if err != nil {
		return nil, err
	}
	allCaller := pl.callerAggs() == len(pl.aggs)
	if conn == nil || !pl.auto() && !allCaller {
		if err := p.write(ctx, tx, pl); err != nil {
			return nil, err
		}
		done = true
		return pl.events, tx.Commit(ctx)
	}
	done = true
	if err := p.writeAndCommit(ctx, conn, tx, pl); err != nil {
		return nil, err
	}
	return pl.events, nil
}

// writeAndCommit sends pl's outbox statement (queueShort's, with commit
// set) and COMMIT in one round trip on conn, where tx is open, and fills
// in the versions. When the statement fails, PostgreSQL skips the COMMIT;
// tx is then rolled back, and a statement that failed because an aggregate
// records another topic is reported as a *TopicConflictError.
func (p *Producer) writeAndCommit(ctx context.Context, conn *pgx.Conn, tx pgx.Tx, pl *plan) error {
	b := &pgx.Batch{}
	var res []aggResult
	var written bool
	p.queueShort(b, pl, true, &res, &written)
	var tag pgconn.CommandTag
	b.Queue("COMMIT").Exec(func(ct pgconn.CommandTag) error { tag = ct; return nil })
	err := conn.SendBatch(ctx, b).Close()
	if err != nil {
		if !written {
			// The outbox statement failed: the COMMIT did not run, and the
			// transaction is aborted.
			rollback(ctx, tx)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == errNotWrittenCode {
				return p.notWritten(ctx, conn, pl)
			}
			return fmt.Errorf("write events to the outbox: %w", err)
		}
		if conn.PgConn().TxStatus() != 'I' {
			rollback(ctx, tx)
		}
		return fmt.Errorf("commit: %w", err)
	}
	if tag.String() != "COMMIT" {
		return pgx.ErrTxCommitRollback
	}
	if res != nil {
		pl.fill(res)
	}
	return nil
}

// notWritten explains why an outbox statement of PublishAndCommit wrote
// nothing, after its transaction was rolled back: the first aggregate of
// the call whose sequence records another topic.
func (p *Producer) notWritten(ctx context.Context, conn *pgx.Conn, pl *plan) error {
	for _, a := range pl.aggs {
		var topic *string
		err := conn.QueryRow(ctx, sqlident.SQL(p.cfg.Schema, `SELECT topic FROM {schema}.aggregate_sequences WHERE aggregate_type = $1 AND aggregate_id = $2`),
			a.typ, a.id).Scan(&topic)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("eventline: the outbox statement wrote nothing and the transaction was rolled back; reading why failed: %w", err)
		}
		if topic != nil && *topic != a.topic {
			return fmt.Errorf("event %d: %w", pl.index(a.events[0]), &TopicConflictError{AggregateType: a.typ, AggregateID: a.id, Topic: *topic, Requested: a.topic})
		}
	}
	// Another transaction recorded the topic, or changed it back,
	// meanwhile.
	return errors.New("eventline: an aggregate's recorded topic changed while the events were written; nothing was committed: retry the transaction")
}

// rollback ends tx, which may be aborted or already ended.
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// ownedTx is the transaction PublishAndCommit gives fn: fn may do anything
// with it but end it.
type ownedTx struct{ pgx.Tx }

var errOwnedTx = errors.New("eventline: PublishAndCommit commits or rolls back the transaction itself: return the events, or an error to roll back")

func (ownedTx) Commit(context.Context) error   { return errOwnedTx }
func (ownedTx) Rollback(context.Context) error { return errOwnedTx }
