package middleware

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/store"
)

// What the external tests reach of the unexported machinery.

// CountUnsafeHolds replaces the pause after an unsafe-composition refusal
// with a counter (no wait), restored when the test ends.
func CountUnsafeHolds(t interface{ Cleanup(func()) }) *atomic.Int32 {
	var n atomic.Int32
	prev := holdUnsafe
	holdUnsafe = func(context.Context) { n.Add(1) }
	t.Cleanup(func() { holdUnsafe = prev })
	return &n
}

// AdmissionOrder is store.AdmissionOrder: the order a batch's admissions are
// queued in.
var AdmissionOrder = store.AdmissionOrder

// SweepResult makes one sweeper pass, as Sweep, and returns what it did.
func (el *Eventline) SweepResult(ctx context.Context) (store.SweepResult, error) {
	return el.sweep(ctx)
}

// ReplayResult is what one pass of dead-letter replays did.
type ReplayResult = replayResult

// ReplayDeadLetters makes one pass of dead-letter replays, as Run does
// every SweepInterval.
func (el *Eventline) ReplayDeadLetters(ctx context.Context) (ReplayResult, error) {
	return el.replayDeadLetters(ctx)
}

// Chain is the chain AddHandler adds for h under name, as a handler
// function to call directly.
func (el *Eventline) Chain(name string, h message.HandlerFunc) message.HandlerFunc {
	return el.chain(name, el.upcasting(h))
}

// Store is the gate's store.
func (el *Eventline) Store() *store.Store { return el.gate.store }

// DeadLetterStore is the dead letters' store (held_events).
func (el *Eventline) DeadLetterStore() *held.Store { return el.held }

// Retry returns the retries of a middleware configured with cfg, alone.
func Retry(cfg Config) (message.HandlerMiddleware, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	el := &Eventline{cfg: cfg}
	return el.retry, nil
}

// ApplyParked releases p through the handler registered under p.Handler,
// as the sweeper does, in the savepoint tx.
func (el *Eventline) ApplyParked(ctx context.Context, tx pgx.Tx, p store.Parked) error {
	return el.gate.applyParked(ctx, tx, p)
}

// DeadLetters is the chain's dead letters around h.
func (el *Eventline) DeadLetters(h message.HandlerFunc) message.HandlerFunc {
	return el.deadLetters(h)
}

// InfraOp is what the middleware was doing when err, an infrastructure
// failure it returned, happened: "begin", "handler", "commit".
func InfraOp(err error) (string, bool) {
	var ie *infraError
	if !errors.As(err, &ie) {
		return "", false
	}
	return ie.op, true
}

// PanicValue is what the handler panicked with, when err is the error its
// panic became.
func PanicValue(err error) (any, bool) {
	var pe *panicError
	if !errors.As(err, &pe) {
		return nil, false
	}
	return pe.value, true
}

// ExhaustedAttempts is how many attempts were made, when err is the
// retries' error after the last one failed.
func ExhaustedAttempts(err error) (int, bool) {
	var e *retriesExhaustedError
	if !errors.As(err, &e) {
		return 0, false
	}
	return e.attempts, true
}

// Traced wraps h in the process span, as the chain does outermost.
func (el *Eventline) Traced(h message.HandlerFunc) message.HandlerFunc {
	return el.gate.obs.traced(el.cfg.Group, h)
}

// CheckMigrated is Run's check of the schema, alone.
func (el *Eventline) CheckMigrated(ctx context.Context) error { return el.checkMigrated(ctx) }
