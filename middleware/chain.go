package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// CompositionError refuses an event because the middleware chain around
// the handler would lose it or apply it twice: a poison queue inside the
// eventline transaction (Watermill's PoisonQueue added to a handler after
// MiddlewareFor) acknowledges a failed handler as a success, so the event
// would be marked processed with no effects; and the eventline middleware
// inside another eventline transaction would nest them. The transaction is
// rolled back and nothing is recorded; the refusal is logged and counted
// in eventline_consumer_unsafe_compositions_total. The error is never
// dead-lettered nor retried against the budget: the event waits until the
// chain is fixed.
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

// guard wraps the chain inside the eventline middleware: it refuses to let
// the transaction commit when that chain hid a failure. Watermill's
// PoisonQueue sets ReasonForPoisonedKey on the message and returns nil
// after publishing a failed message. The key is taken off the message
// while the chain runs, so a message that was poisoned before (and
// replayed) does not look poisoned now.
func (el *Eventline) guard(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		before, had := msg.Metadata[wmiddleware.ReasonForPoisonedKey]
		delete(msg.Metadata, wmiddleware.ReasonForPoisonedKey)
		out, err := h(msg)
		reason, poisoned := msg.Metadata[wmiddleware.ReasonForPoisonedKey]
		if had && !poisoned {
			msg.Metadata[wmiddleware.ReasonForPoisonedKey] = before
		}
		if err != nil || !poisoned {
			return out, err
		}
		cerr := &CompositionError{
			Problem: fmt.Sprintf("a poison queue inside the eventline middleware swallowed the handler's failure (%q), which would mark the event processed with no effects", reason),
			Fix:     "use Eventline.AddHandler, which dead-letters in the consumer's database outside the transaction, and add no poison queue after MiddlewareFor",
		}
		el.cfg.Metrics.add(unsafeCompositionsCounter, 1, el.cfg.Group)
		el.cfg.Logger.ErrorContext(msg.Context(), "eventline: refusing to commit an event: the middleware chain is unsafe",
			"group", el.cfg.Group, "message_uuid", msg.UUID, "error", cerr)
		return nil, cerr
	}
}

// chain is the safe chain around inner (the user's handler, upcasting),
// outermost first:
//
//	trace ▸ dead letter ▸ retry ▸ Config.Middleware ▸ eventline (recover ▸ tx ▸ decode ▸ dedup ▸ gate) ▸ inner
//
// inner is registered for the sweeper and replays under name.
func (el *Eventline) chain(name string, inner message.HandlerFunc) message.HandlerFunc {
	h := el.wrap(name, inner)
	for i := len(el.cfg.Middleware) - 1; i >= 0; i-- {
		h = el.cfg.Middleware[i](h)
	}
	return el.gate.obs.traced(el.cfg.Group, el.deadLetters(el.retry(h)))
}

// AddHandler adds fn to router as the consumer handler name for topic on
// sub, in the one safe chain (see the package documentation, "The chain",
// and Example_router), with fn registered under name for the sweeper and
// dead-letter replays.
//
// The chain is the handler function the Router calls, so middleware added
// to the router (before or after) runs outside it, never inside the
// transaction. Do not add Watermill's PoisonQueue or Retry to that router:
// they would see (and dead-letter) the errors this chain returns only to
// leave a message unacknowledged, at shutdown. AddHandler fails when an
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
	chain := el.chain(name, el.upcasting(func(msg *message.Message) ([]*message.Message, error) { return nil, fn(msg) }))
	return router.AddConsumerHandler(name, topic, sub, func(msg *message.Message) error {
		_, err := chain(msg)
		return err
	}), nil
}

// unsafePause is how long the middleware holds a message it refused for
// an unsafe composition (after its transaction rolled back) before it
// answers. The refusal is the same on every delivery until the chain is
// fixed, and a Router without eventline's retries outside (which back off
// by themselves) redelivers a nacked message at once: without the pause,
// one such message spins thousands of times a second, each an ERROR line.
const unsafePause = time.Second

// holdUnsafe waits unsafePause or until ctx ends; a variable so that tests
// can see it called.
var holdUnsafe = func(ctx context.Context) {
	t := time.NewTimer(unsafePause)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
