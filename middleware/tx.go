package middleware

import (
	"context"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/delivery"
)

// rollbackTimeout bounds a rollback, which runs even when the message
// context has been canceled.
const rollbackTimeout = 10 * time.Second

// runInTx runs h with the open transaction tx in msg's context, commits
// when h succeeds and rolls back otherwise (also when h panics; the panic
// goes on to recoverPanics). The commit happens before runInTx returns, so
// before the router acknowledges the message: an acknowledged message
// always has its effects committed, and a crash between commit and
// acknowledgement only causes a redelivery, which the dedup record then
// recognises. The message context is restored when it returns, so no
// middleware outside sees a finished transaction.
func runInTx(msg *message.Message, tx pgx.Tx, h message.HandlerFunc) (out []*message.Message, err error) {
	orig := msg.Context()
	ctx := delivery.WithTx(orig, tx)
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
	delivery.RunAfterCommit(ctx)
	return out, nil
}

// rollback rolls tx back even when ctx has ended.
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// recoverPanics turns a panic in h into a *panicError, so the message is
// retried like any failure instead of crashing the consumer; runInTx,
// inside it, rolls back while the panic unwinds.
func recoverPanics(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (out []*message.Message, err error) {
		defer func() {
			if r := recover(); r != nil {
				out, err = nil, &panicError{value: r, stack: debug.Stack()}
			}
		}()
		return h(msg)
	}
}

// decode decodes the message with eventline.Decode. A message that does not
// decode (no event id, a non-numeric or negative version, no aggregate…)
// is a permanent error: dead-lettered without retries.
func decode(msg *message.Message) (eventline.Event, error) {
	e, err := eventline.Decode(msg)
	if err != nil {
		return eventline.Event{}, Permanent(fmt.Errorf("message %s: %w", msg.UUID, err))
	}
	return e, nil
}

// eventOf returns the event decoded into msg's context, or decodes it.
func eventOf(msg *message.Message) (eventline.Event, error) {
	if e, ok := delivery.Event(msg.Context()); ok {
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
