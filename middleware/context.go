package middleware

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/txhooks"
)

// TxFromContext returns the consumer transaction the middleware opened for
// the message, or for a parked or late event being applied (then it is a
// savepoint of the applying transaction). Write the handler's effects
// through it: they commit together with the dedup record and the version
// advance, before the message is acknowledged, and roll back with them on
// any error. Do not commit or roll it back yourself.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) { return delivery.Tx(ctx) }

// EventFromContext returns the event decoded from the message, at the
// current payload schema version of its type when Config.Upcasters is
// set. Handlers behind the middleware always find it.
func EventFromContext(ctx context.Context) (eventline.Event, bool) { return delivery.Event(ctx) }

// IsLate reports whether the handler is applying a late event: one whose
// version was given up on (recorded in skipped_versions) or passed, so
// later versions of its aggregate have already been applied. A handler
// sees it under the ApplyLate policy and when an operator applies a held
// late event (`eventline held replay`). Handlers that set state from
// the event ("status = shipped") should not let a late event overwrite
// newer state; additive effects can apply as usual.
func IsLate(ctx context.Context) bool { return delivery.Late(ctx) }

// AfterCommit registers fn to run after the context's consumer transaction
// commits; it never runs when the transaction rolls back. Hooks registered
// while a parked or late event is applied (in a savepoint, by the drain
// that follows its missing version or by the sweeper) run after the
// transaction that applied it commits, and are dropped with its savepoint
// when it fails. With no transaction in ctx, fn runs at once.
//
// A hook that panics does not stop the others, nor reach the caller: the
// transaction has committed, so the panic is recovered, logged with the
// event and counted in eventline_consumer_after_commit_panics_total, and
// the remaining hooks run.
//
// AfterCommit is at most once: a process that crashes between the commit
// and the hook loses the hook, and the redelivered event is a duplicate,
// so its handler (and the hook) does not run again. Use it for what may be
// lost: metrics, cache invalidation, a wake-up. For an external effect
// that must happen (an e-mail, a call to another service), publish a
// follow-up event through the producer's outbox in the consumer
// transaction (producer.PublishTx with the tx from TxFromContext): it
// commits with the handler's writes, the relay delivers it at least once,
// and the service that performs the effect consumes it with its own dedup.
func AfterCommit(ctx context.Context, fn func()) {
	if !txhooks.Add(ctx, fn) {
		fn()
	}
}

// reportHookPanic logs and counts an AfterCommit hook that panicked; ctx
// is the context the hook was registered with.
func (el *Eventline) reportHookPanic(ctx context.Context, v any, stack []byte) {
	el.cfg.Metrics.add(hookPanicsCounter, 1, el.cfg.Group)
	attrs := []any{"group", el.cfg.Group, "panic", v}
	if e, ok := EventFromContext(ctx); ok {
		attrs = append(attrs, "event_id", e.ID, "event_type", e.Type, "aggregate_type", e.AggregateType,
			"aggregate_id", e.AggregateID, "version", e.AggregateVersion)
	}
	el.cfg.Logger.ErrorContext(ctx, "eventline: an AfterCommit hook panicked after its event committed; recovered, the event stays applied and the other hooks ran",
		append(attrs, "stack", string(stack))...)
}
