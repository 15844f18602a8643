package consumer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/configerr"
	"github.com/eventline/eventline/internal/nilcheck"
	"github.com/eventline/eventline/middleware"
)

// HandlerFunc handles one event. tx is the consumer transaction: write the
// event's effects through it, and they commit together with the dedup
// record and the version advance, before the Kafka offset moves. Returning
// an error rolls everything back; the event is retried and finally
// dead-lettered (held in held_events), unless the error says the
// database is unavailable (middleware.IsInfrastructure): then the event
// waits for it and is never dead-lettered. Wrap an error with
// middleware.Permanent to dead-letter at once. Do not commit or roll back
// tx.
type HandlerFunc func(ctx context.Context, tx pgx.Tx, e eventline.Event) error

// Errors of the consumer's life: registering handlers and running.
var (
	// ErrRunning is returned by Handle and Ignore after Run started, and
	// by a second Run, whether the first is still running or has returned:
	// a Consumer runs once; create a new one to run again.
	ErrRunning = errors.New("eventline: consumer was already started; register handlers before Run, and run a Consumer once (create a new one to run again)")
	// ErrNoHandlers is returned by Run when no handler is registered and
	// no event type ignored: every event would be dead-lettered as
	// unknown.
	ErrNoHandlers = errors.New("eventline: consumer has no handlers: register them with Handle or HandleJSON (and list the types to skip with Ignore) before Run")
	// ErrUnknownEventType is matched by *UnknownEventTypeError.
	ErrUnknownEventType = errors.New("eventline: no handler for the event type")
)

// UnknownEventTypeError dead-letters an event whose type has no handler. It
// is permanent.
type UnknownEventTypeError struct {
	// Type is the event type without a handler.
	Type string
	// Group is the consumer group.
	Group string
}

// Error implements error; the message says how to handle the type.
func (e *UnknownEventTypeError) Error() string {
	return fmt.Sprintf("eventline: consumer group %q has no handler for event type %q: register one with Handle, or list the type with Ignore to apply it as a no-op",
		e.Group, e.Type)
}

// Unwrap lets errors.Is(err, ErrUnknownEventType) match.
func (e *UnknownEventTypeError) Unwrap() error { return ErrUnknownEventType }

// Consumer consumes eventline events from Kafka and applies each one once,
// in per-aggregate order, in a PostgreSQL transaction (see the package
// documentation). Register handlers, then call Run.
type Consumer struct {
	db  middleware.Pool
	cfg Config
	el  *middleware.Eventline

	mu         sync.Mutex
	running    bool
	handlers   map[string]HandlerFunc
	validators map[string][]func(eventline.Event) error
	ignored    map[string]bool

	// hard is canceled when in-flight events must be abandoned (set by
	// Run).
	hard context.Context
	// sleep, when set, replaces the retry and wait timers (tests).
	sleep func(ctx context.Context, d time.Duration) error
	// coalesce, when not 0, replaces the number of coalescer slots (tests;
	// below 0: no coalescing).
	coalesce int
	// coalesceHook is the coalescer's hook (tests).
	coalesceHook func(alone bool, waiting int)
}

// New returns a consumer that writes through db (a *pgxpool.Pool; keep it
// for the consumer's lifetime). It fails, naming the field, when cfg is
// invalid. It does not connect to anything.
func New(db middleware.Pool, cfg Config) (*Consumer, error) {
	if nilcheck.IsNil(db) {
		return nil, errors.New("consumer.New: db is nil: pass the consumer's *pgxpool.Pool")
	}
	cfg = cfg.runnerDefaults()
	if err := cfg.validateRunner(); err != nil {
		return nil, err
	}
	c := &Consumer{
		db: db, cfg: cfg,
		handlers:   map[string]HandlerFunc{},
		validators: map[string][]func(eventline.Event) error{},
		ignored:    map[string]bool{},
	}
	mcfg := cfg.Config
	mcfg.Validate = c.validate
	// Outermost first, inside the retries: a context that outlives the
	// subscriber's (detach), the event-type check, the user's own.
	mcfg.Middleware = append([]message.HandlerMiddleware{c.detach, c.knownType}, cfg.Middleware...)
	el, err := middleware.New(db, mcfg)
	if err != nil {
		return nil, configerr.Rename(err, "consumer.Config")
	}
	c.el = el
	return c, nil
}

// HandleOption configures a handler registered with Handle or HandleJSON.
type HandleOption func(*handleOptions)

type handleOptions struct {
	validate []func(eventline.Event) error
}

// WithValidate gives a handler a check the gate runs before it parks an
// event of the handler's type (or holds it as late): an event that fails
// it could never be applied, so it is dead-lettered at once with the
// check's error as the reason, instead of waiting parked and failing when
// its turn comes. It must not touch the database. HandleJSON adds one that
// decodes the payload into the handler's type.
func WithValidate(fn func(e eventline.Event) error) HandleOption {
	return func(o *handleOptions) {
		if fn != nil {
			o.validate = append(o.validate, fn)
		}
	}
}

// Handle registers fn for events of eventType. It fails after Run started
// and when the type already has a handler.
func (c *Consumer) Handle(eventType string, fn HandlerFunc, opts ...HandleOption) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.running:
		return ErrRunning
	case strings.TrimSpace(eventType) == "":
		return fmt.Errorf("consumer.Handle(%q): event type is empty: name the type its events carry", eventType)
	case fn == nil:
		return fmt.Errorf("consumer.Handle(%q): handler is nil", eventType)
	case c.handlers[eventType] != nil || c.ignored[eventType]:
		return fmt.Errorf("consumer.Handle(%q): the event type already has a handler", eventType)
	}
	var o handleOptions
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	c.handlers[eventType] = fn
	c.validators[eventType] = o.validate
	c.cfg.Metrics.RegisterEventTypes(eventType)
	return nil
}

// HandleJSON registers fn for events of eventType, decoding each payload
// from JSON into a T first, after Config.Upcasters brought it to the
// current schema version. A payload that does not decode is a permanent
// error: the event is dead-lettered without retries, also when it arrives
// out of order (the gate checks the payload before parking it).
func HandleJSON[T any](c *Consumer, eventType string, fn func(ctx context.Context, tx pgx.Tx, e eventline.Event, payload T) error, opts ...HandleOption) error {
	if fn == nil {
		return fmt.Errorf("consumer.HandleJSON(%q): handler is nil", eventType)
	}
	decodes := WithValidate(func(e eventline.Event) error {
		_, err := eventline.DecodePayload[T](e)
		return err
	})
	return c.Handle(eventType, func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		payload, err := eventline.DecodePayload[T](e)
		if err != nil {
			return middleware.Permanent(fmt.Errorf("event %s (%s): %w", e.ID, e.Type, err))
		}
		return fn(ctx, tx, e, payload)
	}, append([]HandleOption{decodes}, opts...)...)
}

// validate is the gate's ValidateFunc: the event's type has a handler (or
// is ignored), its payload can be upcast to the version the handler reads,
// and it passes the handler's checks.
func (c *Consumer) validate(ctx context.Context, e eventline.Event) error {
	if c.handlers[e.Type] == nil {
		return c.unknown(e.Type)
	}
	// The handler's checks see what the handler will: the payload upcast
	// to the current version (the middleware refused, before this, an
	// event the upcasters cannot bring there).
	u, err := c.cfg.Upcasters.Upcast(e)
	if err != nil {
		return err
	}
	for _, v := range c.validators[e.Type] {
		if err := v(u); err != nil {
			return err
		}
	}
	if c.cfg.Validate != nil {
		return c.cfg.Validate(ctx, e)
	}
	return nil
}

// Ignore lists event types this consumer does not act on. Their events
// still pass dedup and the version gate, so they advance their aggregate's
// version (otherwise every later event of the aggregate would wait behind a
// gap), but no handler runs. Events of types neither handled nor ignored are
// dead-lettered.
func (c *Consumer) Ignore(eventTypes ...string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.running {
		return ErrRunning
	}
	// Check every type first: a refused call ignores none of them.
	for _, t := range eventTypes {
		if strings.TrimSpace(t) == "" {
			return fmt.Errorf("consumer.Ignore(%q): event type is empty: name the type its events carry", t)
		}
		if c.handlers[t] != nil {
			return fmt.Errorf("consumer.Ignore(%q): the event type has a handler", t)
		}
	}
	for _, t := range eventTypes {
		c.ignored[t] = true
		c.cfg.Metrics.RegisterEventTypes(t)
	}
	return nil
}

// handlerName is the Watermill handler name the consumer gives a topic's
// handler; parked events and dead letters record it.
func handlerName(group, topic string) string { return "eventline/" + group + "/" + topic }

// dispatch is the Watermill handler inside the eventline middleware: it
// calls the handler registered for the event's type, with the event at
// the current payload schema version (the middleware upcast it).
func (c *Consumer) dispatch(msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := middleware.TxFromContext(ctx)
	if !ok {
		return middleware.ErrNoTx
	}
	e, ok := middleware.EventFromContext(ctx)
	if !ok {
		return errors.New("eventline: no decoded event in the message context")
	}
	fn := c.handlers[e.Type]
	if fn == nil {
		return middleware.Permanent(c.unknown(e.Type))
	}
	return fn(ctx, tx, e)
}

// unknown is the error of an event type without a handler: nil when the
// type is ignored.
func (c *Consumer) unknown(eventType string) error {
	if c.ignored[eventType] {
		return nil
	}
	return &UnknownEventTypeError{Type: eventType, Group: c.cfg.Group}
}

// knownType rejects, before any database work, a message whose event type
// has no handler.
func (c *Consumer) knownType(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if t := msg.Metadata.Get(eventline.MetaEventType); t != "" && c.handlers[t] == nil {
			if err := c.unknown(t); err != nil {
				return nil, middleware.Permanent(err)
			}
		}
		return h(msg)
	}
}
