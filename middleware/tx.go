package middleware

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
)

// TxBeginner begins transactions; *pgxpool.Pool satisfies it.
type TxBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// rollbackTimeout bounds a rollback, which runs even when the message
// context has been canceled.
const rollbackTimeout = 10 * time.Second

// Tx runs the rest of the chain in a database transaction. It begins a
// transaction on DB, puts it in the message context ([TxFromContext]),
// commits it when the handler succeeds and rolls it back when the handler
// returns an error or panics (the panic continues to the next recover).
// The commit happens before Tx returns, so before the router acknowledges
// the message: an acknowledged message always has its effects committed,
// and a crash between commit and acknowledgement only causes a redelivery,
// which the dedup record then recognises.
//
// The message context is restored when Tx returns, so no middleware
// outside sees a finished transaction.
type Tx struct {
	// DB begins the transactions. Required.
	DB TxBeginner
	// Options are the transaction options. Defaults to the zero value:
	// read committed, read-write.
	Options pgx.TxOptions
}

// Middleware returns the Tx middleware.
func (t Tx) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (out []*message.Message, err error) {
		if t.DB == nil {
			return nil, errors.New("eventline: middleware.Tx.DB is nil: give it the consumer's *pgxpool.Pool")
		}
		return inTx(msg, t.DB, t.Options, h)
	}
}

// inTx runs h with a transaction in msg's context.
func inTx(msg *message.Message, db TxBeginner, opts pgx.TxOptions, h message.HandlerFunc) (out []*message.Message, err error) {
	tx, err := db.BeginTx(msg.Context(), opts)
	if err != nil {
		return nil, fmt.Errorf("eventline: begin consumer transaction: %w", err)
	}
	return runInTx(msg, tx, h)
}

// runInTx runs h with the open transaction tx in msg's context, commits
// when h succeeds and rolls back otherwise (also when h panics).
func runInTx(msg *message.Message, tx pgx.Tx, h message.HandlerFunc) (out []*message.Message, err error) {
	orig := msg.Context()
	ctx := ContextWithTx(orig, tx)
	done := false
	defer func() {
		msg.SetContext(orig)
		if !done {
			rollback(orig, tx)
		}
	}()
	msg.SetContext(ctx)
	out, err = h(msg)
	if err != nil {
		return nil, err
	}
	done = true
	if err := tx.Commit(orig); err != nil {
		return nil, &commitError{err: err}
	}
	RunAfterCommit(ctx)
	return out, nil
}

// rollback rolls tx back even when ctx has ended.
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// Recover turns a panic in the rest of the chain into a *PanicError, so the
// message is retried like any failure instead of crashing the consumer.
// Place it outside Tx: Tx rolls back while the panic unwinds.
func Recover(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (out []*message.Message, err error) {
		defer func() {
			if r := recover(); r != nil {
				out, err = nil, &PanicError{Value: r, Stack: debug.Stack()}
			}
		}()
		return h(msg)
	}
}

// Decode decodes the message with eventline.Decode and puts the event in
// the message context ([EventFromContext]). A message that does not decode
// (no event id, a non-numeric or negative version, no aggregate…) never
// reaches the handler: Decode returns a permanent error, so it is
// dead-lettered without retries.
func Decode(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		e, err := decode(msg)
		if err != nil {
			return nil, err
		}
		msg.SetContext(ContextWithEvent(msg.Context(), e))
		return h(msg)
	}
}

func decode(msg *message.Message) (eventline.Event, error) {
	e, err := eventline.Decode(msg)
	if err != nil {
		return eventline.Event{}, Permanent(fmt.Errorf("message %s: %w", msg.UUID, err))
	}
	return e, nil
}

// eventOf returns the event decoded by Decode, or decodes it.
func eventOf(msg *message.Message) (eventline.Event, error) {
	if e, ok := EventFromContext(msg.Context()); ok {
		return e, nil
	}
	return decode(msg)
}

// commitError is a failed COMMIT. When the connection died during it the
// outcome is unknown: the transaction may have committed.
type commitError struct{ err error }

func (e *commitError) Error() string {
	return "eventline: commit consumer transaction: " + e.err.Error()
}

func (e *commitError) Unwrap() error { return e.err }
