package delivery

import (
	"context"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/txhooks"
)

type ctxKey int

const (
	txKey ctxKey = iota
	eventKey
	lateKey
)

// WithTx returns ctx carrying tx as the consumer transaction, with a new
// set of after-commit hooks (see [RunAfterCommit]).
func WithTx(ctx context.Context, tx pgx.Tx) context.Context {
	ctx = context.WithValue(ctx, txKey, tx)
	ctx, _ = txhooks.New(ctx)
	return ctx
}

// WithSavepoint returns ctx carrying sp, a savepoint of the transaction in
// ctx, with its own hook set: Promote it when the savepoint is released
// (its hooks then run when the transaction commits), Drop it when the
// savepoint is rolled back.
func WithSavepoint(ctx context.Context, sp pgx.Tx) (context.Context, *txhooks.Set) {
	ctx = context.WithValue(ctx, txKey, sp)
	return txhooks.Child(ctx)
}

// Tx returns the consumer transaction in ctx.
func Tx(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey).(pgx.Tx)
	return tx, ok && tx != nil
}

// RunAfterCommit runs, once, the hooks registered on a context made by
// WithTx; call it after the transaction committed.
func RunAfterCommit(ctx context.Context) { txhooks.From(ctx).Run() }

// WithEvent returns ctx carrying the decoded event.
func WithEvent(ctx context.Context, e eventline.Event) context.Context {
	return context.WithValue(ctx, eventKey, e)
}

// Event returns the decoded event in ctx.
func Event(ctx context.Context) (eventline.Event, bool) {
	e, ok := ctx.Value(eventKey).(eventline.Event)
	return e, ok
}

// WithLate marks ctx as applying a late event.
func WithLate(ctx context.Context) context.Context { return context.WithValue(ctx, lateKey, true) }

// Late reports whether ctx applies a late event.
func Late(ctx context.Context) bool {
	late, _ := ctx.Value(lateKey).(bool)
	return late
}

// Upcast returns the message to hand a handler for msg, whose decoded
// event is e: msg itself when e is at the current schema version of its
// type (or up knows no other), else a copy whose payload and
// event_version are the upcast ones, with the upcast event in its context.
// msg keeps the bytes as written, so what is parked or dead-lettered is
// the event as it was published. The error (an event up cannot bring to
// the current version) matches eventline.ErrInvalidEvent.
func Upcast(up *eventline.Upcasters, msg *message.Message, e eventline.Event) (*message.Message, error) {
	u, err := up.Upcast(e)
	if err != nil {
		return nil, fmt.Errorf("message %s: %w", msg.UUID, err)
	}
	if u.SchemaVersion == e.SchemaVersion {
		return msg, nil
	}
	c := msg.Copy()
	c.Payload = u.Payload
	c.Metadata.Set(eventline.MetaEventVersion, strconv.Itoa(u.SchemaVersion))
	c.SetContext(WithEvent(msg.Context(), u))
	return c, nil
}
