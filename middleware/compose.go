package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// ErrUnsafeComposition is matched by *CompositionError.
var ErrUnsafeComposition = errors.New("eventline: unsafe middleware composition")

// CompositionError refuses an event because the middleware chain around
// the handler would lose it or apply it twice: a poison queue inside the
// eventline transaction acknowledges a failed handler as a success (the
// event would be marked processed with no effects), and a retry inside it
// runs the handler again in the same transaction (its writes would commit
// twice). The transaction is rolled back and nothing is recorded. The
// error is neither retried against a budget nor dead-lettered by [Retry]
// and [DeadLetter]: the event waits until the chain is fixed.
type CompositionError struct {
	// Problem says what is wrong; Fix what to do.
	Problem string
	Fix     string // see Problem
}

// Error implements error.
func (e *CompositionError) Error() string {
	return fmt.Sprintf("eventline: unsafe middleware composition: %s; %s. The event was rolled back and is not marked as processed", e.Problem, e.Fix)
}

// Unwrap lets errors.Is(err, ErrUnsafeComposition) match.
func (e *CompositionError) Unwrap() error { return ErrUnsafeComposition }

// Innermost marks h as the handler itself, innermost in the chain, so the
// eventline middleware can tell when it is entered twice in one
// transaction (a retry placed inside the transaction) and refuse to commit.
// [Eventline.AddHandler] and the consumer runner wrap handlers with it;
// wrap yours when you compose the chain yourself.
func Innermost(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if st := txStateOf(msg.Context()); st != nil && st.entries.Add(1) > 1 {
			return nil, retryInside()
		}
		return h(msg)
	}
}

func retryInside() error {
	return &CompositionError{Problem: "the handler ran more than once in one consumer transaction (a retry middleware sits inside the eventline middleware), so its writes would commit twice",
		Fix: "put retries outside the eventline middleware: use Eventline.AddHandler, or DeadLetter ▸ Retry ▸ eventline"}
}

// guard wraps the chain inside the eventline middleware: it refuses to let
// the transaction commit when that chain hid a failure. Watermill's
// PoisonQueue sets ReasonForPoisonedKey on the message and returns nil
// after publishing a failed message; a retry inside makes Innermost see the
// handler twice. The key is taken off the message while the chain runs, so
// a message that was poisoned before (and replayed) does not look poisoned
// now.
func (el *Eventline) guard(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		st := txStateOf(msg.Context())
		before, had := msg.Metadata[wmiddleware.ReasonForPoisonedKey]
		delete(msg.Metadata, wmiddleware.ReasonForPoisonedKey)
		out, err := h(msg)
		reason, poisoned := msg.Metadata[wmiddleware.ReasonForPoisonedKey]
		if had && !poisoned {
			msg.Metadata[wmiddleware.ReasonForPoisonedKey] = before
		}
		var cerr *CompositionError
		switch {
		case st != nil && st.entries.Load() > 1:
			cerr, _ = retryInside().(*CompositionError)
		case err == nil && poisoned:
			cerr = &CompositionError{
				Problem: fmt.Sprintf("a poison queue inside the eventline middleware swallowed the handler's failure (%q), which would mark the event processed with no effects", reason),
				Fix:     "put the poison queue (or eventline's DeadLetter) outside Retry and the eventline middleware: use Eventline.AddHandler",
			}
		default:
			return out, err
		}
		el.cfg.Metrics.incUnsafeComposition(el.cfg.Group)
		el.cfg.Logger.ErrorContext(msg.Context(), "eventline: refusing to commit an event: the middleware chain is unsafe",
			"group", el.cfg.Group, "message_uuid", msg.UUID, "error", cerr)
		return nil, cerr
	}
}

// Chain returns the safe chain around a handler as one middleware,
// outermost first:
//
//	dead letter ▸ retry ▸ eventline (recover ▸ tx ▸ decode ▸ dedup ▸ gate) ▸ h
//
// with Config.Retry's schedule and dead letters held in held_events.
// h is wrapped with [Innermost]. Nothing a Router adds inside it can
// change the order, but a middleware added between Chain and the handler
// (a handler-level middleware added after it) is inside the transaction;
// [Eventline.AddHandler] rules that out.
func (el *Eventline) Chain(h message.HandlerFunc) message.HandlerFunc {
	inner := Innermost(el.upcasting(h))
	el.gate.reg.wrap(inner)
	return el.safeChain(inner)
}

// safeChain composes the chain of Chain and AddHandler around inner, the
// user's handler already wrapped in Innermost.
func (el *Eventline) safeChain(inner message.HandlerFunc) message.HandlerFunc {
	return el.Traced(el.dl.Middleware(el.cfg.Retry.Middleware(el.handler(el.guard(inner)))))
}

// AddHandler adds fn to router as the consumer handler name for topic on
// sub, wrapped in [Eventline.Chain]: the one call that composes dead
// letters, retries and the eventline middleware in the only safe order.
//
//	el, err := middleware.New(middleware.Config{DB: pool, Group: "billing"})
//	_, err = el.AddHandler(router, "billing", "orders", kafkaSubscriber, func(msg *message.Message) error {
//		tx, _ := middleware.TxFromContext(msg.Context())
//		e, _ := middleware.EventFromContext(msg.Context())
//		_, err := tx.Exec(msg.Context(), `INSERT INTO invoices (event_id) VALUES ($1)`, e.ID)
//		return err
//	})
//	go el.RunSweeper(ctx) // parked events, and dead letters replayed on request
//
// The chain is the handler function the Router calls, so middleware added
// to the router (before or after) runs outside it, never inside the
// transaction. Do not add Watermill's PoisonQueue or Retry to that router:
// they would see (and dead-letter) the errors this chain returns only to
// leave a message unacknowledged, at shutdown. The handler is registered
// for the sweeper and for replays under name. AddHandler fails when an
// argument is missing or the router already has a handler of that name.
func (el *Eventline) AddHandler(router *message.Router, name, topic string, sub message.Subscriber, fn message.NoPublishHandlerFunc) (*message.Handler, error) {
	switch {
	case router == nil:
		return nil, errors.New("middleware.Eventline.AddHandler: router is nil")
	case name == "" || topic == "":
		return nil, errors.New("middleware.Eventline.AddHandler: name and topic are required")
	case sub == nil:
		return nil, errors.New("middleware.Eventline.AddHandler: subscriber is nil")
	case fn == nil:
		return nil, errors.New("middleware.Eventline.AddHandler: handler is nil")
	}
	if _, dup := router.Handlers()[name]; dup {
		return nil, fmt.Errorf("middleware.Eventline.AddHandler: the router already has a handler named %q", name)
	}
	inner := Innermost(el.upcasting(func(msg *message.Message) ([]*message.Message, error) { return nil, fn(msg) }))
	el.gate.Register(name, inner)
	chain := el.safeChain(inner)
	return router.AddConsumerHandler(name, topic, sub, func(msg *message.Message) error {
		_, err := chain(msg)
		return err
	}), nil
}

// UnsafePause is how long the middleware holds a message it refused for an
// unsafe composition (after its transaction rolled back) before it
// answers. The refusal is the same on every delivery until the chain is
// fixed, and a Router without eventline's Retry outside (which backs off
// by itself) redelivers a nacked message at once: without the pause, one
// such message spins thousands of times a second, each an ERROR line.
const UnsafePause = time.Second

// holdUnsafe waits UnsafePause or until ctx ends; a variable so that tests
// can see it called.
var holdUnsafe = func(ctx context.Context) {
	t := time.NewTimer(UnsafePause)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
