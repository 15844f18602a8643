package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/versioning"
)

// gate is the version gate of the middleware (see package versioning for
// the rules), with the handler registry the sweeper and replays release
// events through.
type gate struct {
	cfg   *Config                                      // the middleware's, defaults filled in
	check func(context.Context, eventline.Event) error // Config.Validate behind the upcasters
	store *store.Store
	reg   *registry
	obs   observer // tracing.go
}

// newSweeper returns the sweeper of the gate's group, releasing parked
// events through the registered handlers.
func (g *gate) newSweeper(db store.Pool) *store.Sweeper {
	txTimeout := g.cfg.TxTimeout
	if txTimeout <= 0 {
		txTimeout = time.Minute // transactions are unbounded: the sweeper still bounds each aggregate's
	}
	return g.store.NewSweeper(db, store.SweeperConfig{
		Group: g.cfg.Group, ParkTimeout: g.cfg.ParkTimeout, Interval: g.cfg.SweepInterval, Batch: g.cfg.SweepBatch,
		TxTimeout: txTimeout, Logger: g.cfg.Logger,
		Release: g.releaseOptions(g.applyParked),
		OnSweep: g.observeSweep,
	})
}

// releaseOptions are the gate's release limits with apply.
func (g *gate) releaseOptions(apply store.ApplyFunc) store.ReleaseOptions {
	return store.ReleaseOptions{Apply: apply, MaxAttempts: g.cfg.MaxReleaseAttempts, Backoff: g.cfg.ReleaseBackoff,
		Permanent: IsPermanent}
}

func (g *gate) observeSweep(r store.SweepResult, err error) {
	m := g.cfg.Metrics
	m.add(releasedCounter, r.Released, g.cfg.Group)
	m.add(releaseFailuresCounter, r.Failed, g.cfg.Group)
	m.add(gapsSkippedCounter, r.GapsSkipped, g.cfg.Group, "park_timeout")
	m.observeGapsClosed(g.cfg.Group, r.GapsClosed)
	m.addGivenUp(g.cfg.Group, r.DeadLettered)
	m.add(lateAppliedCounter, r.LateApplied, g.cfg.Group)
	if err == nil {
		m.setParked(g.cfg.Group, r.Parked, r.HeldLate)
	}
}

// applyParked is the sweeper's store.ApplyFunc: it runs the handler
// registered for p.Handler with p's message, the savepoint tx and the
// decoded event in its context (and IsLate for a late event). Hooks the
// handler registers with AfterCommit run when the sweeper's transaction
// commits. Messages the handler returns are dropped with a warning (see
// the package documentation).
func (g *gate) applyParked(ctx context.Context, tx pgx.Tx, p store.Parked) error {
	h, err := g.handler(p.Handler)
	if err != nil {
		return err
	}
	out, err := g.release(ctx, tx, p, h)
	if err == nil && len(out) > 0 {
		g.cfg.Logger.WarnContext(ctx, "eventline: messages returned by a handler while the sweeper released a parked event were dropped; publish through the transaction instead",
			"group", p.Group, "event_id", p.EventID, "dropped", len(out))
	}
	return err
}

// handler is the handler registered under name, or an error matching
// versioning.ErrNoHandler that says what to add.
func (g *gate) handler(name string) (message.HandlerFunc, error) {
	if h := g.reg.lookup(name); h != nil {
		return h, nil
	}
	return nil, fmt.Errorf("%w: %q; add it with AddHandler (or MiddlewareFor) under that name", versioning.ErrNoHandler, name)
}

// release runs h for a parked or late event in the savepoint tx. The
// handler's AfterCommit hooks join those of the enclosing transaction when
// it succeeds, and are dropped when it fails.
func (g *gate) release(ctx context.Context, tx pgx.Tx, p store.Parked, h message.HandlerFunc) (out []*message.Message, err error) {
	e, err := p.Event()
	if err != nil {
		return nil, Permanent(err)
	}
	msg := p.Message()
	if tr := g.obs.tr; tr != nil {
		// A "release" span under the releasing span (the process span of
		// the event that filled the gap, or none in the sweeper), linked
		// to the trace the event arrived with.
		var span trace.Span
		ctx, span = tr.StartRelease(ctx, p.Topic, g.cfg.Group, e, p.Metadata)
		span.SetAttributes(tracing.AttrParkedSeconds.Float64(time.Since(p.ParkedAt).Seconds()))
		if p.Late {
			span.SetAttributes(tracing.AttrLate.Bool(true))
		}
		defer func() { tracing.End(span, err) }()
	}
	hctx, hooks := delivery.WithSavepoint(ctx, tx)
	hctx = delivery.WithEvent(hctx, e)
	if p.Late {
		hctx = delivery.WithLate(hctx)
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
			AfterCommit(hctx, func() { g.observeStage(stageParkedToReleased, time.Since(parkedAt)) })
		}
		hooks.Promote()
		promoted = true
	}
	return out, err
}

// precheck rejects what the gate refuses before any database work.
func (g *gate) precheck(e eventline.Event) error {
	if e.AggregateVersion == 0 && g.cfg.Unversioned == versioning.RejectUnversioned {
		return Permanent(fmt.Errorf("event %s (%s): %w", e.ID, e.Type, versioning.ErrUnversioned))
	}
	return nil
}

// jumps reports whether a gap applies e anyway (the Apply policy).
func (g *gate) jumps(e eventline.Event) bool {
	return policyFor(g.cfg.PolicyByType, e.Type, g.cfg.GapPolicy) == versioning.Apply
}

// refuse counts and logs an event the gate refuses for good, and returns
// err marked permanent (it is dead-lettered with err as the reason).
func (g *gate) refuse(ctx context.Context, e eventline.Event, reason string, err error) error {
	g.cfg.Metrics.add(refusedCounter, 1, g.cfg.Group, reason)
	g.cfg.Logger.WarnContext(ctx, "eventline: event refused; it is dead-lettered", "group", g.cfg.Group, "event_id", e.ID,
		"event_type", e.Type, "aggregate_type", e.AggregateType, "aggregate_id", e.AggregateID, "version", e.AggregateVersion,
		"reason", reason, "error", err)
	return Permanent(err)
}

// refusal classifies an error from Park or HoldLate: the event's fault
// (refused, permanent) or the database's (returned as is).
func (g *gate) refusal(ctx context.Context, e eventline.Event, err error) error {
	switch {
	case errors.Is(err, versioning.ErrGapTooLarge):
		return g.refuse(ctx, e, refusedGapTooLarge, err)
	case errors.Is(err, eventline.ErrInvalidEvent):
		return g.refuse(ctx, e, refusedInvalid, err)
	}
	return err
}

// validate runs Config.Validate (behind the upcasters); a failure refuses
// the event.
func (g *gate) validate(ctx context.Context, e eventline.Event, what string) error {
	if g.check == nil {
		return nil
	}
	if err := g.check(ctx, e); err != nil {
		return g.refuse(ctx, e, refusedInvalid, fmt.Errorf("event %s (%s) cannot be %s: it could never be applied: %w", e.ID, e.Type, what, err))
	}
	return nil
}

// registry maps Watermill handler names to the handler the gate wraps, so
// the sweeper can release a parked event through the handler it arrived on
// (registered, learned, or the only one: see the package documentation,
// "Parked events and the handler registry").
type registry struct {
	mu sync.RWMutex
	// handlers holds each name's registered handler, or the one learned
	// under it when none is registered.
	handlers map[string]message.HandlerFunc
	wrapped  int
	only     message.HandlerFunc
}

func newRegistry() *registry {
	return &registry{handlers: map[string]message.HandlerFunc{}}
}

// register records h, wrapped by the gate, under name, overriding
// anything learned.
func (r *registry) register(name string, h message.HandlerFunc) {
	r.mu.Lock()
	r.wrapped++
	r.only = h
	r.handlers[name] = h
	r.mu.Unlock()
}

// learn records h under name unless name is known already.
func (r *registry) learn(name string, h message.HandlerFunc) {
	if name == "" {
		return
	}
	r.mu.RLock()
	_, known := r.handlers[name]
	r.mu.RUnlock()
	if known {
		return
	}
	r.mu.Lock()
	if _, ok := r.handlers[name]; !ok {
		r.handlers[name] = h
	}
	r.mu.Unlock()
}

// lookup returns the handler for name, or nil.
func (r *registry) lookup(name string) message.HandlerFunc {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if h, ok := r.handlers[name]; ok {
		return h
	}
	if r.wrapped == 1 {
		return r.only
	}
	return nil
}
