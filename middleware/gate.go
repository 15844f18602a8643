package middleware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/versioning"
)

// ValidateFunc checks, without applying it, that an event could be applied:
// its type has a handler and its payload decodes for it. The gate calls it
// before parking an event or holding it as late, so an event that could
// never be applied is refused (dead-lettered at once with the reason)
// instead of waiting for its turn and failing then. A non-nil error is
// treated as permanent.
type ValidateFunc func(ctx context.Context, e eventline.Event) error

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
	// LatePolicy is what happens to a late event: one whose version was
	// given up on before it arrived. Defaults to versioning.HoldLate.
	LatePolicy versioning.LatePolicy
	// LatePolicyByType overrides LatePolicy per event type.
	LatePolicyByType map[string]versioning.LatePolicy
	// MaxGap bounds the versions one event may leave missing in front of
	// it; an event beyond it is refused as permanent (an inflated
	// version). An event that declares its predecessor
	// (versioning.DeclaresPredecessor) is not bounded: it waits for that
	// one event. Defaults to versioning.DefaultMaxGap (1000).
	MaxGap int64
	// Validate, when set, is called before an event is parked or held as
	// late (see ValidateFunc). The consumer package supplies one that
	// checks the event type has a handler and, for HandleJSON handlers,
	// that the payload decodes.
	Validate ValidateFunc
	// Unversioned is what happens to an event without an aggregate
	// version. Defaults to versioning.PassUnversioned.
	Unversioned versioning.UnversionedPolicy
	// MaxReleaseAttempts, ReleaseBackoff and MaxReleaseBackoff bound the
	// attempts to apply a parked event once its turn came (see
	// versioning.SweeperConfig). Default to
	// versioning.DefaultMaxReleaseAttempts (10),
	// versioning.DefaultReleaseBackoff (5s) and
	// versioning.DefaultMaxReleaseBackoff (5m).
	MaxReleaseAttempts int
	ReleaseBackoff     time.Duration // see MaxReleaseAttempts
	MaxReleaseBackoff  time.Duration // see MaxReleaseAttempts
	// DeadLetter stores a parked event that was given up (see
	// versioning.DeadLetterFunc). Defaults to the store's HoldFailed:
	// it is held as late (held_events) for an operator.
	DeadLetter versioning.DeadLetterFunc
	// Logger receives debug lines for duplicates and stale events and
	// warnings for skipped gaps, late events and failed releases.
	// Defaults to slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts what the gate does.
	Metrics *Metrics
	// TracerProvider, when set, makes the gate record the outcome of each
	// event on its process span (see Eventline.Traced) and a "release
	// <topic>" span, linked to the trace the event arrived with, when a
	// parked event is applied. Defaults to nil: no spans.
	TracerProvider trace.TracerProvider
	// Propagator reads a parked event's trace context from its stored
	// metadata. Defaults to OpenTelemetry's global propagator if the
	// application set one, else W3C trace context and baggage.
	Propagator propagation.TextMapPropagator
	// MeterProvider, when set, receives the stage latencies as the OTel
	// histogram eventline.stage.duration. Defaults to nil.
	MeterProvider metric.MeterProvider
}

func (c GateConfig) withDefaults() GateConfig {
	if c.Schema == "" {
		c.Schema = migrations.DefaultSchema
	}
	if c.GapPolicy == "" {
		c.GapPolicy = versioning.DefaultGapPolicy
	}
	if c.LatePolicy == "" {
		c.LatePolicy = versioning.DefaultLatePolicy
	}
	if c.MaxGap == 0 {
		c.MaxGap = versioning.DefaultMaxGap
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
	if strings.TrimSpace(c.Group) == "" {
		return fmt.Errorf("%s.Group is empty: name the consumer group (dedup records and versions are kept per group)", field)
	}
	if err := sqlident.Text(field+".Group", c.Group); err != nil {
		return err
	}
	if err := sqlident.Validate(field+".Schema", c.Schema); err != nil {
		return err
	}
	if err := (versioning.Policies{Default: c.GapPolicy, ByType: c.PolicyByType}).Validate(field); err != nil {
		return err
	}
	if err := (versioning.LatePolicies{Default: c.LatePolicy, ByType: c.LatePolicyByType}).Validate(field); err != nil {
		return err
	}
	switch {
	case !c.Unversioned.Valid():
		return fmt.Errorf("%s.Unversioned %q is unknown: use %q or %q", field, c.Unversioned, versioning.PassUnversioned, versioning.RejectUnversioned)
	case c.MaxGap < 0:
		return fmt.Errorf("%s.MaxGap is %d; it must be positive (0 means %d; math.MaxInt64 disables the bound)", field, c.MaxGap, versioning.DefaultMaxGap)
	case c.MaxReleaseAttempts < 0:
		return fmt.Errorf("%s.MaxReleaseAttempts is %d; it must be positive (0 means %d)", field, c.MaxReleaseAttempts, versioning.DefaultMaxReleaseAttempts)
	case c.ReleaseBackoff < 0 || c.MaxReleaseBackoff < 0:
		return fmt.Errorf("%s.ReleaseBackoff and MaxReleaseBackoff must not be negative (0 means %s and %s)", field, versioning.DefaultReleaseBackoff, versioning.DefaultMaxReleaseBackoff)
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
	late     versioning.LatePolicies
	store    *versioning.Store
	reg      *registry
	obs      observer // tracing.go
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
	obs, err := newObserver(cfg.TracerProvider, cfg.Propagator, cfg.MeterProvider)
	if err != nil {
		return nil, fmt.Errorf("%s.MeterProvider: %w", field, err)
	}
	return &Gate{
		obs:      obs,
		cfg:      cfg,
		policies: versioning.Policies{Default: cfg.GapPolicy, ByType: cfg.PolicyByType},
		late:     versioning.LatePolicies{Default: cfg.LatePolicy, ByType: cfg.LatePolicyByType},
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
// gate's own middleware (the sweeper supplies transaction and event). A
// nil h is ignored: it would hide a handler the gate learned.
func (g *Gate) Register(handlerName string, h message.HandlerFunc) {
	if h == nil {
		return
	}
	g.reg.register(handlerName, h)
}

// NewSweeper returns a sweeper for the gate's group that releases parked
// events through the registered handlers. See versioning.Sweeper. Release
// limits and the dead letter not set in cfg come from the gate's
// configuration.
func (g *Gate) NewSweeper(db versioning.Pool, cfg versioning.SweeperConfig) (*versioning.Sweeper, error) {
	cfg.Group = g.cfg.Group
	cfg.Apply = g.ApplyParked
	cfg.Permanent = IsPermanent
	if cfg.Logger == nil {
		cfg.Logger = g.cfg.Logger
	}
	opts := g.releaseOptions(nil)
	if cfg.MaxReleaseAttempts == 0 {
		cfg.MaxReleaseAttempts = opts.MaxAttempts
	}
	if cfg.ReleaseBackoff == 0 {
		cfg.ReleaseBackoff = opts.Backoff
	}
	if cfg.MaxReleaseBackoff == 0 {
		cfg.MaxReleaseBackoff = opts.MaxBackoff
	}
	if cfg.DeadLetter == nil {
		cfg.DeadLetter = opts.DeadLetter
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

// releaseOptions are the gate's release limits with apply.
func (g *Gate) releaseOptions(apply versioning.ApplyFunc) versioning.ReleaseOptions {
	return versioning.ReleaseOptions{Apply: apply, MaxAttempts: g.cfg.MaxReleaseAttempts, Backoff: g.cfg.ReleaseBackoff,
		MaxBackoff: g.cfg.MaxReleaseBackoff, Permanent: IsPermanent, DeadLetter: g.cfg.DeadLetter}
}

func (g *Gate) observeSweep(r versioning.SweepResult, err error) {
	m := g.cfg.Metrics
	m.addReleased(g.cfg.Group, r.Released)
	m.addReleaseFailures(g.cfg.Group, r.Failed)
	m.addGapsSkipped(g.cfg.Group, "park_timeout", r.GapsSkipped)
	m.observeGapsClosed(g.cfg.Group, r.GapsClosed)
	m.addGivenUp(g.cfg.Group, r.DeadLettered)
	m.addLateApplied(g.cfg.Group, r.LateApplied)
	if err == nil {
		m.setParked(g.cfg.Group, r.Parked, r.HeldLate)
	}
}

// ApplyParked is the sweeper's versioning.ApplyFunc: it runs the handler
// registered for p.Handler with p's message, the savepoint tx and the
// decoded event in its context (and IsLate for a late event). Hooks the
// handler registers with AfterCommit run when the sweeper's transaction
// commits. Messages the handler returns cannot be published from the
// sweeper and are dropped with a warning; handlers that emit events should
// write them with the producer's PublishTx through tx.
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

// applyParked runs h for a parked or late event in the savepoint tx. The
// handler's AfterCommit hooks join those of the enclosing transaction when
// it succeeds, and are dropped when it fails.
func (g *Gate) applyParked(ctx context.Context, tx pgx.Tx, p versioning.Parked, h message.HandlerFunc) (out []*message.Message, err error) {
	e, err := p.Event()
	if err != nil {
		return nil, Permanent(err)
	}
	msg := p.Message()
	if tr := g.obs.tr; tr != nil {
		// A "release" span under the releasing span (the process span of
		// the event that filled the gap, or none in the sweeper), linked
		// to the trace the event arrived with.
		link, linked := tr.LinkTo(p.Metadata)
		var span trace.Span
		ctx, span = tr.StartRelease(ctx, p.Topic, g.cfg.Group, e, link, linked)
		span.SetAttributes(tracing.AttrParkedSeconds.Float64(time.Since(p.ParkedAt).Seconds()))
		if p.Late {
			span.SetAttributes(tracing.AttrLate.Bool(true))
		}
		defer func() { tracing.End(span, err) }()
	}
	hctx, hooks := contextWithSavepoint(ctx, tx)
	hctx = ContextWithEvent(hctx, e)
	if p.Late {
		hctx = contextWithLate(hctx)
	}
	msg.SetContext(hctx)
	promoted := false
	defer func() {
		if !promoted { // failed or panicked: the savepoint rolls back
			hooks.Drop()
		}
	}()
	start := time.Now()
	out, err = h(msg)
	g.cfg.Metrics.observeHandler(g.cfg.Group, e.Type, time.Since(start))
	if err == nil {
		if g.stagesOn() && !p.Late && !p.ParkedAt.IsZero() {
			parkedAt := p.ParkedAt
			AfterCommit(hctx, func() { g.observeStage(StageParkedToReleased, time.Since(parkedAt)) })
		}
		hooks.Promote()
		promoted = true
	}
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

// refuse counts and logs an event the gate refuses for good, and returns
// err marked permanent (it is dead-lettered with err as the reason).
func (g *Gate) refuse(ctx context.Context, e eventline.Event, reason string, err error) error {
	g.cfg.Metrics.incRefused(g.cfg.Group, reason)
	g.cfg.Logger.WarnContext(ctx, "eventline: event refused; it is dead-lettered", "group", g.cfg.Group, "event_id", e.ID,
		"event_type", e.Type, "aggregate_type", e.AggregateType, "aggregate_id", e.AggregateID, "version", e.AggregateVersion,
		"reason", reason, "error", err)
	return Permanent(err)
}

// refusal classifies an error from Park or HoldLate: the event's fault
// (refused, permanent) or the database's (returned as is).
func (g *Gate) refusal(ctx context.Context, e eventline.Event, err error) error {
	switch {
	case errors.Is(err, versioning.ErrGapTooLarge):
		return g.refuse(ctx, e, RefusedGapTooLarge, err)
	case errors.Is(err, eventline.ErrInvalidEvent):
		return g.refuse(ctx, e, RefusedInvalid, err)
	}
	return err
}

// validate runs the configured ValidateFunc; a failure refuses the event.
func (g *Gate) validate(ctx context.Context, e eventline.Event, what string) error {
	if g.cfg.Validate == nil {
		return nil
	}
	if err := g.cfg.Validate(ctx, e); err != nil {
		return g.refuse(ctx, e, RefusedInvalid, fmt.Errorf("event %s (%s) cannot be %s: it could never be applied: %w", e.ID, e.Type, what, err))
	}
	return nil
}
