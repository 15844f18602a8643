package middleware

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/versioning"
)

// proceed acts on an admission: skip a duplicate, settle a stale or late
// event, park a gap, or run the handler (auditing a jump) and drain parked
// successors. a's zero value means "apply, no version involved" (an
// unversioned event).
func (g *gate) proceed(msg *message.Message, tx pgx.Tx, e eventline.Event, h message.HandlerFunc, a store.Admission) ([]*message.Message, error) {
	ctx := msg.Context()
	name := delivery.SourceOf(ctx).Handler
	g.reg.learn(name, h)
	group, m, log := g.cfg.Group, g.cfg.Metrics, g.cfg.Logger
	k := store.Key{Group: group, AggregateType: e.AggregateType, AggregateID: e.AggregateID}
	switch a.Verdict {
	case store.Duplicate:
		g.duplicate(ctx, e)
		g.obs.outcome(ctx, tracing.OutcomeDuplicate)
		return nil, nil
	case store.Stale:
		return g.stale(msg, tx, e, h, a)
	case store.Gap:
		if err := g.validate(ctx, e, "parked"); err != nil {
			return nil, err
		}
		req := store.ParkRequest{Group: group, Event: e, Handler: name, Topic: e.Topic, Message: msg, Current: a.Previous, MaxGap: g.cfg.MaxGap}
		if _, err := g.store.Park(ctx, tx, req); err != nil {
			return nil, g.refusal(ctx, e, err)
		}
		log.InfoContext(ctx, "eventline: event parked until the missing versions arrive", "group", group, "event_id", e.ID,
			"aggregate_type", e.AggregateType, "aggregate_id", e.AggregateID, "version", e.AggregateVersion, "follows", a.Follows, "current", a.Previous)
		AfterCommit(ctx, func() { m.add(parkedCounter, 1, group, m.eventType(e.Type)) })
		g.obs.outcome(ctx, tracing.OutcomeParked)
		return nil, nil
	case store.Jump:
		if !a.Declared && a.Missing() > g.cfg.MaxGap {
			return nil, g.refuse(ctx, e, refusedGapTooLarge, &versioning.GapTooLargeError{AggregateType: e.AggregateType, AggregateID: e.AggregateID,
				EventID: e.ID, Version: e.AggregateVersion, Previous: a.Follows, Known: a.Previous, MaxGap: g.cfg.MaxGap})
		}
		reason := fmt.Sprintf("gap policy apply: event %s (v%d) applied over the missing versions", e.ID, e.AggregateVersion)
		if err := g.store.RecordSkipped(ctx, tx, k, a.Previous+1, a.Follows, reason); err != nil {
			return nil, err
		}
		log.WarnContext(ctx, "eventline: skipped missing aggregate versions (gap policy apply)", "group", group,
			"aggregate_type", e.AggregateType, "aggregate_id", e.AggregateID, "from", a.Previous+1, "to", a.Follows)
		AfterCommit(ctx, func() { m.add(gapsSkippedCounter, 1, group, "policy_apply") })
	}

	out, err := g.run(msg, e, h)
	if err != nil {
		return nil, err
	}
	if a.Parked == 0 {
		return out, nil
	}
	apply := func(ctx context.Context, sp pgx.Tx, p store.Parked) error {
		ph := h
		if p.Handler != name {
			var err error
			if ph, err = g.handler(p.Handler); err != nil {
				return err
			}
		}
		produced, err := g.release(ctx, sp, p, ph)
		if err == nil {
			out = append(out, produced...)
		}
		return err
	}
	d, err := g.store.Drain(ctx, tx, k, a.Current, g.releaseOptions(apply))
	if err != nil {
		return nil, err
	}
	for _, p := range d.DeadLettered {
		log.ErrorContext(ctx, "eventline: gave up on a parked event that cannot be applied; dead-lettered, its version recorded as skipped",
			"group", group, "aggregate_type", k.AggregateType, "aggregate_id", k.AggregateID,
			"version", p.Version, "event_id", p.EventID, "attempts", p.ReleaseAttempts, "error", p.LastError)
	}
	if d.Failed != nil {
		log.WarnContext(ctx, "eventline: parked event failed to apply; it stays parked and the sweeper retries it after a backoff",
			"group", group, "aggregate_type", k.AggregateType, "aggregate_id", k.AggregateID,
			"version", d.Failed.Version, "event_id", d.Failed.EventID, "error", d.FailErr)
	}
	if d.Late > 0 {
		log.WarnContext(ctx, "eventline: parked events whose version the aggregate passed were held as late",
			"group", group, "aggregate_type", k.AggregateType, "aggregate_id", k.AggregateID, "late", d.Late)
	}
	AfterCommit(ctx, func() {
		m.add(releasedCounter, len(d.Released), group)
		m.observeGapsClosed(group, d.GapsClosed)
		m.addGivenUp(group, len(d.DeadLettered))
		if d.Failed != nil {
			m.add(releaseFailuresCounter, 1, group)
		}
	})
	return out, nil
}

// stale settles an event the aggregate is already past: late when its
// version was given up on (held, or applied now under ApplyLate); a
// version conflict, held for the operator, when it is a replayed dead
// letter (see conflict); else discarded as stale.
func (g *gate) stale(msg *message.Message, tx pgx.Tx, e eventline.Event, h message.HandlerFunc, a store.Admission) ([]*message.Message, error) {
	ctx := msg.Context()
	group, m, log := g.cfg.Group, g.cfg.Metrics, g.cfg.Logger
	hold := policyFor(g.cfg.LatePolicyByType, e.Type, g.cfg.LatePolicy) == versioning.HoldLate
	req := store.LateRequest{Group: group, Event: e, Message: msg, Handler: delivery.SourceOf(ctx).Handler, Topic: e.Topic, Current: a.Previous, Hold: hold}
	late, reason, err := g.store.HoldLate(ctx, tx, req)
	if err != nil {
		return nil, g.refusal(ctx, e, err)
	}
	attrs := []any{"group", group, "event_id", e.ID, "event_type", e.Type, "aggregate_type", e.AggregateType,
		"aggregate_id", e.AggregateID, "version", e.AggregateVersion, "current", a.Previous}
	if !late && isReplay(ctx) {
		return nil, g.conflict(ctx, tx, req, attrs)
	}
	if !late {
		log.DebugContext(ctx, "eventline: stale event discarded", attrs...)
		AfterCommit(ctx, func() { m.add(staleCounter, 1, group, m.eventType(e.Type)) })
		g.obs.outcome(ctx, tracing.OutcomeStale)
		return nil, nil
	}
	if hold {
		if err := g.validate(ctx, e, "held as late"); err != nil {
			return nil, err
		}
		g.held(ctx, e, "eventline: late event held for the operator: its version was given up on before it arrived; replay it (applied late) with `eventline held replay` or discard it with `eventline held discard`",
			append(attrs, "skip_reason", reason))
		return nil, nil
	}
	log.WarnContext(ctx, "eventline: late event applied after later versions (late policy apply)", append(attrs, "skip_reason", reason)...)
	msg.SetContext(delivery.WithLate(ctx))
	out, err := g.run(msg, e, h)
	if err != nil {
		return nil, err
	}
	AfterCommit(ctx, func() { m.add(lateCounter, 1, group, m.eventType(e.Type), "applied") })
	return out, nil
}

// conflict holds a replayed dead letter whose version the aggregate
// passed while it was dead (an event that was never applied, so not a
// duplicate): another event took its version, or a successor declared an
// earlier predecessor. It is held as late (held_events, cause version_conflict) for the operator, under
// every late policy, never discarded as stale.
//
// Only replays are checked: naming the event that took the version is a
// lookup of processed_events by aggregate and version, affordable on this
// rare, operator-driven path but not for every stale arrival, since
// processed_events is keyed by event id and the lookup reads the group's
// records. An arrival from Kafka that is merely stale is discarded as
// before (a redelivery whose dedup record expired is one).
func (g *gate) conflict(ctx context.Context, tx pgx.Tx, req store.LateRequest, attrs []any) error {
	if err := g.validate(ctx, req.Event, "held as a version conflict"); err != nil {
		return err
	}
	reason, err := g.store.HoldConflict(ctx, tx, req)
	if err != nil {
		return g.refusal(ctx, req.Event, err)
	}
	g.held(ctx, req.Event, "eventline: replayed event held for the operator: the aggregate passed its version while it was dead (version conflict); replay it (applied late) with `eventline held replay` or discard it with `eventline held discard`",
		append(attrs, "reason", reason))
	return nil
}

// held logs (msg, attrs) and counts an event held for the operator, whose
// version was skipped: a late event, or a replay's version conflict.
func (g *gate) held(ctx context.Context, e eventline.Event, msg string, attrs []any) {
	g.cfg.Logger.WarnContext(ctx, msg, attrs...)
	group, m := g.cfg.Group, g.cfg.Metrics
	AfterCommit(ctx, func() { m.add(lateCounter, 1, group, m.eventType(e.Type), "held") })
	g.obs.outcome(ctx, tracing.OutcomeSkipped)
}

// run calls the handler for an event applied on arrival.
func (g *gate) run(msg *message.Message, e eventline.Event, h message.HandlerFunc) ([]*message.Message, error) {
	start := time.Now()
	out, err := h(msg)
	g.cfg.Metrics.observeHandler(g.cfg.Group, e.Type, time.Since(start))
	if err != nil {
		return nil, err
	}
	group, m := g.cfg.Group, g.cfg.Metrics
	ctx := msg.Context()
	AfterCommit(ctx, func() {
		m.add(appliedCounter, 1, group, m.eventType(e.Type))
		g.observeApplied(ctx, e)
	})
	g.obs.outcome(ctx, tracing.OutcomeApplied)
	return out, nil
}

func (g *gate) duplicate(ctx context.Context, e eventline.Event) {
	g.cfg.Logger.DebugContext(ctx, "eventline: duplicate event skipped", "group", g.cfg.Group, "event_id", e.ID, "event_type", e.Type)
	group, m := g.cfg.Group, g.cfg.Metrics
	AfterCommit(ctx, func() { m.add(duplicateCounter, 1, group, m.eventType(e.Type)) })
}
