package middleware

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/versioning"
)

// GateConfig configures the version gate.
type GateConfig struct {
	// Group is the consumer group: versions, dedup records and parked
	// events are kept per group. Required.
	Group string
	// Schema is the PostgreSQL schema holding eventline's tables. Defaults
	// to "eventline".
	Schema string
	// GapPolicy is what happens to an event that arrives ahead of a
	// missing version. Defaults to versioning.Park.
	GapPolicy versioning.GapPolicy
	// PolicyByType overrides GapPolicy per event type.
	PolicyByType map[string]versioning.GapPolicy
	// Unversioned is what happens to an event without an aggregate
	// version. Defaults to versioning.PassUnversioned.
	Unversioned versioning.UnversionedPolicy
	// Logger receives debug lines for duplicates and stale events and
	// warnings for skipped gaps and failed releases. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts what the gate does.
	Metrics *Metrics
}

func (c GateConfig) withDefaults() GateConfig {
	if c.Schema == "" {
		c.Schema = migrations.DefaultSchema
	}
	if c.GapPolicy == "" {
		c.GapPolicy = versioning.DefaultGapPolicy
	}
	if c.Unversioned == "" {
		c.Unversioned = versioning.DefaultUnversionedPolicy
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c GateConfig) validate(field string) error {
	if c.Group == "" {
		return fmt.Errorf("%s.Group is empty: name the consumer group (dedup records and versions are kept per group)", field)
	}
	if err := sqlident.Validate(field+".Schema", c.Schema); err != nil {
		return err
	}
	if err := (versioning.Policies{Default: c.GapPolicy, ByType: c.PolicyByType}).Validate(field); err != nil {
		return err
	}
	if !c.Unversioned.Valid() {
		return fmt.Errorf("%s.Unversioned %q is unknown: use %q or %q", field, c.Unversioned, versioning.PassUnversioned, versioning.RejectUnversioned)
	}
	return nil
}

// Gate is the version gate as a Watermill middleware (see package
// versioning for the rules). It needs a consumer transaction in the message
// context (put [Tx] outside it). On its own it does not deduplicate; put
// [Dedup] outside it, or use the composed middleware from [New], which does
// both in one statement.
//
// A Gate remembers the handlers it wraps, by Watermill handler name, so
// parked events can be released through the handler they arrived on (see
// [Gate.Register]).
type Gate struct {
	cfg      GateConfig
	policies versioning.Policies
	store    *versioning.Store
	reg      *registry
}

// NewGate returns a version gate. It fails, naming the field, when the
// configuration is invalid.
func NewGate(cfg GateConfig) (*Gate, error) {
	return newGate(cfg, "middleware.GateConfig")
}

// newGate builds a gate; field names the config in validation errors.
func newGate(cfg GateConfig, field string) (*Gate, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(field); err != nil {
		return nil, err
	}
	store, err := versioning.NewStore(cfg.Schema)
	if err != nil {
		return nil, err
	}
	return &Gate{
		cfg:      cfg,
		policies: versioning.Policies{Default: cfg.GapPolicy, ByType: cfg.PolicyByType},
		store:    store,
		reg:      newRegistry(),
	}, nil
}

// Store returns the gate's versioning store (for ListParked, ReleaseGap…).
func (g *Gate) Store() *versioning.Store { return g.store }

// Middleware returns the gate as a Watermill middleware.
func (g *Gate) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return g.middleware(h)
}

// MiddlewareFor returns the gate as a middleware that also registers the
// handler it wraps under handlerName (use it as a handler-level middleware:
// router.AddConsumerHandler(name, …).AddMiddleware(gate.MiddlewareFor(name))).
func (g *Gate) MiddlewareFor(handlerName string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		wrapped := g.middleware(h)
		g.reg.register(handlerName, h)
		return wrapped
	}
}

// Register tells the gate which handler releases events parked under the
// Watermill handler name handlerName. The sweeper needs it to release events
// parked before a restart when the router has several handlers: names are
// otherwise learned only when a handler receives a message, and the
// fallback, the only handler the gate wrapped, works only when there is
// exactly one. Pass the same function given to the router, without the
// gate's own middleware (the sweeper supplies transaction and event).
func (g *Gate) Register(handlerName string, h message.HandlerFunc) {
	g.reg.register(handlerName, h)
}

// NewSweeper returns a sweeper for the gate's group that releases parked
// events through the registered handlers. See versioning.Sweeper.
func (g *Gate) NewSweeper(db versioning.Pool, cfg versioning.SweeperConfig) (*versioning.Sweeper, error) {
	cfg.Group = g.cfg.Group
	cfg.Apply = g.ApplyParked
	if cfg.Logger == nil {
		cfg.Logger = g.cfg.Logger
	}
	next := cfg.OnSweep
	cfg.OnSweep = func(r versioning.SweepResult, err error) {
		g.observeSweep(r, err)
		if next != nil {
			next(r, err)
		}
	}
	return g.store.NewSweeper(db, cfg)
}

func (g *Gate) observeSweep(r versioning.SweepResult, err error) {
	m := g.cfg.Metrics
	m.addReleased(g.cfg.Group, r.Released)
	m.addReleaseFailures(g.cfg.Group, r.Failed)
	m.addGapsSkipped(g.cfg.Group, "park_timeout", r.GapsSkipped)
	if err == nil {
		m.setParked(g.cfg.Group, r.Parked)
	}
}

// ApplyParked is the sweeper's versioning.ApplyFunc: it runs the handler
// registered for p.Handler with p's message, the savepoint tx and the
// decoded event in its context. Messages the handler returns cannot be
// published from the sweeper and are dropped with a warning; handlers that
// emit events should write them with the producer's PublishTx through tx.
func (g *Gate) ApplyParked(ctx context.Context, tx pgx.Tx, p versioning.Parked) error {
	h := g.reg.lookup(p.Handler)
	if h == nil {
		return fmt.Errorf("%w: %q; register it with Register or MiddlewareFor", versioning.ErrNoHandler, p.Handler)
	}
	out, err := g.applyParked(ctx, tx, p, h)
	if err == nil && len(out) > 0 {
		g.cfg.Logger.WarnContext(ctx, "eventline: messages returned by a handler while the sweeper released a parked event were dropped; publish through the transaction instead",
			"group", p.Group, "event_id", p.EventID, "dropped", len(out))
	}
	return err
}

func (g *Gate) applyParked(ctx context.Context, tx pgx.Tx, p versioning.Parked, h message.HandlerFunc) ([]*message.Message, error) {
	e, err := p.Event()
	if err != nil {
		return nil, Permanent(err)
	}
	msg := p.Message()
	msg.SetContext(ContextWithEvent(ContextWithTx(ctx, tx), e))
	start := time.Now()
	out, err := h(msg)
	g.cfg.Metrics.observeHandler(g.cfg.Group, e.Type, time.Since(start))
	return out, err
}

// middleware is the stand-alone gate: it admits the event with its own
// statement in the transaction from the context.
func (g *Gate) middleware(h message.HandlerFunc) message.HandlerFunc {
	g.reg.wrap(h)
	return func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := TxFromContext(msg.Context())
		if !ok {
			return nil, ErrNoTx
		}
		e, err := eventOf(msg)
		if err != nil {
			return nil, err
		}
		if _, ok := EventFromContext(msg.Context()); !ok {
			msg.SetContext(ContextWithEvent(msg.Context(), e))
		}
		if err := g.precheck(e); err != nil {
			return nil, err
		}
		var a versioning.Admission
		if e.AggregateVersion > 0 {
			if a, err = g.store.Admit(msg.Context(), tx, g.cfg.Group, e, g.jumps(e), false); err != nil {
				return nil, err
			}
		}
		return g.proceed(msg, tx, e, h, a)
	}
}

// precheck rejects what the gate refuses before any database work.
func (g *Gate) precheck(e eventline.Event) error {
	if e.AggregateVersion == 0 && g.cfg.Unversioned == versioning.RejectUnversioned {
		return Permanent(fmt.Errorf("event %s (%s): %w", e.ID, e.Type, versioning.ErrUnversioned))
	}
	return nil
}

// jumps reports whether a gap applies e anyway (the Apply policy).
func (g *Gate) jumps(e eventline.Event) bool { return g.policies.For(e.Type) == versioning.Apply }

// proceed acts on an admission: skip a duplicate, record a stale event,
// park or reject a gap, or run the handler (auditing a jump) and drain
// parked successors. a's zero value means "apply, no version involved"
// (an unversioned event).
func (g *Gate) proceed(msg *message.Message, tx pgx.Tx, e eventline.Event, h message.HandlerFunc, a versioning.Admission) ([]*message.Message, error) {
	ctx := msg.Context()
	name := HandlerName(ctx)
	g.reg.learn(name, h)
	group, m, log := g.cfg.Group, g.cfg.Metrics, g.cfg.Logger
	k := versioning.Key{Group: group, AggregateType: e.AggregateType, AggregateID: e.AggregateID}
	switch a.Verdict {
	case versioning.Duplicate:
		g.duplicate(ctx, e)
		return nil, nil
	case versioning.Stale:
		if err := g.store.Discard(ctx, tx, group, e.ID); err != nil {
			return nil, err
		}
		log.DebugContext(ctx, "eventline: stale event discarded", "group", group, "event_id", e.ID,
			"aggregate_type", e.AggregateType, "aggregate_id", e.AggregateID, "version", e.AggregateVersion, "current", a.Previous)
		AfterCommit(ctx, func() { m.incStale(group, e.Type) })
		return nil, nil
	case versioning.Gap:
		if g.policies.For(e.Type) == versioning.Reject {
			return nil, &versioning.GapError{AggregateType: e.AggregateType, AggregateID: e.AggregateID, Version: e.AggregateVersion, Current: a.Previous}
		}
		if _, err := g.store.Park(ctx, tx, versioning.ParkRequest{Group: group, Event: e, Handler: name, Topic: e.Topic, Message: msg}); err != nil {
			return nil, err
		}
		log.InfoContext(ctx, "eventline: event parked until the missing versions arrive", "group", group, "event_id", e.ID,
			"aggregate_type", e.AggregateType, "aggregate_id", e.AggregateID, "version", e.AggregateVersion, "current", a.Previous)
		AfterCommit(ctx, func() { m.incParked(group, e.Type) })
		return nil, nil
	case versioning.Jump:
		reason := fmt.Sprintf("gap policy apply: event %s (v%d) applied over the missing versions", e.ID, e.AggregateVersion)
		if err := g.store.RecordSkipped(ctx, tx, k, a.Previous+1, e.AggregateVersion-1, reason); err != nil {
			return nil, err
		}
		log.WarnContext(ctx, "eventline: skipped missing aggregate versions (gap policy apply)", "group", group,
			"aggregate_type", e.AggregateType, "aggregate_id", e.AggregateID, "from", a.Previous+1, "to", e.AggregateVersion-1)
		AfterCommit(ctx, func() { m.addGapsSkipped(group, "policy_apply", 1) })
	}

	out, err := g.run(msg, e, h)
	if err != nil {
		return nil, err
	}
	if a.Parked == 0 {
		return out, nil
	}
	apply := func(ctx context.Context, sp pgx.Tx, p versioning.Parked) error {
		ph := h
		if p.Handler != name {
			if ph = g.reg.lookup(p.Handler); ph == nil {
				return fmt.Errorf("%w: %q", versioning.ErrNoHandler, p.Handler)
			}
		}
		produced, err := g.applyParked(ctx, sp, p, ph)
		if err == nil {
			out = append(out, produced...)
		}
		return err
	}
	d, err := g.store.Drain(ctx, tx, k, a.Current, apply)
	if err != nil {
		return nil, err
	}
	if d.Failed != nil {
		log.WarnContext(ctx, "eventline: parked event failed to apply; it stays parked and the sweeper retries it",
			"group", group, "aggregate_type", k.AggregateType, "aggregate_id", k.AggregateID,
			"version", d.Failed.Version, "event_id", d.Failed.EventID, "error", d.FailErr)
	}
	AfterCommit(ctx, func() {
		m.addReleased(group, len(d.Released))
		if d.Failed != nil {
			m.addReleaseFailures(group, 1)
		}
	})
	return out, nil
}

// run calls the handler for an event applied on arrival.
func (g *Gate) run(msg *message.Message, e eventline.Event, h message.HandlerFunc) ([]*message.Message, error) {
	start := time.Now()
	out, err := h(msg)
	g.cfg.Metrics.observeHandler(g.cfg.Group, e.Type, time.Since(start))
	if err != nil {
		return nil, err
	}
	group, m := g.cfg.Group, g.cfg.Metrics
	AfterCommit(msg.Context(), func() { m.incApplied(group, e.Type) })
	return out, nil
}

func (g *Gate) duplicate(ctx context.Context, e eventline.Event) {
	g.cfg.Logger.DebugContext(ctx, "eventline: duplicate event skipped", "group", g.cfg.Group, "event_id", e.ID, "event_type", e.Type)
	group, m := g.cfg.Group, g.cfg.Metrics
	AfterCommit(ctx, func() { m.incDuplicate(group, e.Type) })
}
