package middleware

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
)

type ctxKey int

const (
	txKey ctxKey = iota
	eventKey
	sourceKey
)

// txState is what the Tx middleware puts in the message context: the
// transaction and the hooks to run once it has committed.
type txState struct {
	tx pgx.Tx
	// entries counts how often a handler wrapped with Innermost was
	// entered in this transaction: more than once means a retry runs
	// inside it.
	entries atomic.Int32

	mu          sync.Mutex
	afterCommit []func()
}

// txStateOf returns the consumer transaction's state in ctx, or nil.
func txStateOf(ctx context.Context) *txState {
	st, _ := ctx.Value(txKey).(*txState)
	return st
}

// TxFromContext returns the consumer transaction the Tx middleware (or the
// composed middleware) opened for the message, or for a parked event being
// released (then it is a savepoint of the releasing transaction). Write the
// handler's effects through it: they commit together with the dedup record
// and the version advance, before the message is acknowledged, and roll
// back with them on any error. Do not commit or roll it back yourself.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	st, ok := ctx.Value(txKey).(*txState)
	if !ok || st == nil || st.tx == nil {
		return nil, false
	}
	return st.tx, true
}

// ContextWithTx returns ctx carrying tx as the consumer transaction, for
// calling a handler directly (in tests, or from your own middleware). Hooks
// registered on the returned context run when tx's owner calls
// [RunAfterCommit]; the Tx middleware does that after its commit.
func ContextWithTx(ctx context.Context, tx pgx.Tx) context.Context {
	return context.WithValue(ctx, txKey, &txState{tx: tx})
}

// EventFromContext returns the event decoded from the message by the
// Decode step. Handlers behind the composed middleware always find it.
func EventFromContext(ctx context.Context) (eventline.Event, bool) {
	e, ok := ctx.Value(eventKey).(eventline.Event)
	return e, ok
}

// ContextWithEvent returns ctx carrying e, as the Decode step does.
func ContextWithEvent(ctx context.Context, e eventline.Event) context.Context {
	return context.WithValue(ctx, eventKey, e)
}

// AfterCommit registers fn to run after the context's consumer transaction
// commits (it never runs when the transaction rolls back). With no
// transaction in ctx, fn runs at once. eventline uses it to count metrics
// only for effects that really happened.
func AfterCommit(ctx context.Context, fn func()) {
	st, ok := ctx.Value(txKey).(*txState)
	if !ok || st == nil {
		fn()
		return
	}
	st.mu.Lock()
	st.afterCommit = append(st.afterCommit, fn)
	st.mu.Unlock()
}

// RunAfterCommit runs, once, the hooks registered with AfterCommit on a
// context made by ContextWithTx. Call it after committing the transaction
// yourself; the Tx middleware calls it for you.
func RunAfterCommit(ctx context.Context) {
	st, ok := ctx.Value(txKey).(*txState)
	if !ok || st == nil {
		return
	}
	st.mu.Lock()
	hooks := st.afterCommit
	st.afterCommit = nil
	st.mu.Unlock()
	for _, fn := range hooks {
		fn()
	}
}
