package middleware

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/tracing"
)

// The stages of eventline_consumer_stage_seconds and of the OTel
// histogram eventline.stage.duration.
const (
	// stageRelayedToApplied runs from the Kafka record's timestamp (when
	// the relay produced it) to the commit of the transaction that
	// applied the event on arrival.
	stageRelayedToApplied = "relayed_to_applied"
	// stageOccurredToApplied runs from the event's occurred_at (the
	// PublishTx time, unless the publisher set OccurredAt) to the same
	// commit. The outbox's commit time itself is not carried with the
	// event; occurred_at is written in the publishing transaction.
	stageOccurredToApplied = "occurred_to_applied"
	// stageParkedToReleased runs from when an event was parked to the
	// commit of the transaction that applied it.
	stageParkedToReleased = "parked_to_released"
)

// stageHistogramName is the OTel histogram of stage latencies, in
// seconds, with attributes eventline.consumer.group and eventline.stage.
const stageHistogramName = "eventline.stage.duration"

// observer is the consumer side's OpenTelemetry: a nil tracer and a nil
// histogram are off.
type observer struct {
	tr     *tracing.Tracer
	stages metric.Float64Histogram
}

func newObserver(tp trace.TracerProvider, prop propagation.TextMapPropagator, mp metric.MeterProvider) (observer, error) {
	o := observer{tr: tracing.New(tp, prop)}
	if mp != nil {
		h, err := mp.Meter(tracing.ScopeName).Float64Histogram(stageHistogramName, metric.WithUnit("s"),
			metric.WithDescription("Latency of an event's stages through eventline (see the stage attribute)."),
			metric.WithExplicitBucketBoundaries(stageBuckets...))
		if err != nil {
			return observer{}, err
		}
		o.stages = h
	}
	return o, nil
}

// procSpanKey keys the process span in a message context.
type procSpanKey struct{}

// startProcess starts the "process <topic>" span of msg, continuing the
// trace its headers carry, and returns the context carrying it.
func (o observer) startProcess(msg *message.Message, group string) (context.Context, trace.Span) {
	parent := msg.Context()
	ctx, span := o.tr.StartProcess(o.tr.Extract(parent, msg.Metadata), delivery.SourceOf(parent), group, eventFromMetadata(msg.Metadata))
	return context.WithValue(ctx, procSpanKey{}, span), span
}

// processSpan returns the process span in ctx, if any.
func processSpan(ctx context.Context) (trace.Span, bool) {
	sp, ok := ctx.Value(procSpanKey{}).(trace.Span)
	return sp, ok
}

// outcome records on the process span of ctx what became of the event,
// marking a late event (applied under ApplyLate) as such.
func (o observer) outcome(ctx context.Context, outcome string) {
	if o.tr == nil {
		return
	}
	if sp, ok := processSpan(ctx); ok {
		sp.SetAttributes(tracing.AttrOutcome.String(outcome))
		if IsLate(ctx) {
			sp.SetAttributes(tracing.AttrLate.Bool(true))
		}
	}
}

// traced wraps h (the chain puts it outermost, outside the dead letters
// and retries, and the eventline middleware again inside them) in one
// "process <topic>" span per delivery (see the package documentation,
// "Tracing"), unless the message context has one already. Without a
// TracerProvider it returns h itself.
func (o observer) traced(group string, h message.HandlerFunc) message.HandlerFunc {
	if o.tr == nil {
		return h
	}
	return func(msg *message.Message) (out []*message.Message, err error) {
		parent := msg.Context()
		if _, ok := processSpan(parent); ok {
			return h(msg)
		}
		ctx, span := o.startProcess(msg, group)
		msg.SetContext(ctx)
		defer func() {
			msg.SetContext(parent)
			tracing.End(span, err)
		}()
		return h(msg)
	}
}

// observeStage records one stage latency in the Prometheus histogram and,
// when a MeterProvider is set, the OTel one.
func (g *gate) observeStage(stage string, d time.Duration) {
	g.cfg.Metrics.observeStage(g.cfg.Group, stage, d)
	if h := g.obs.stages; h != nil {
		h.Record(context.Background(), d.Seconds(), metric.WithAttributes(
			attribute.String("eventline.consumer.group", g.cfg.Group), attribute.String("eventline.stage", stage)))
	}
}

// stagesOn reports whether stage latencies are recorded anywhere.
func (g *gate) stagesOn() bool { return g.cfg.Metrics != nil || g.obs.stages != nil }

// observeApplied records the stages of an event applied on arrival; it
// runs after the commit.
func (g *gate) observeApplied(ctx context.Context, e eventline.Event) {
	if !g.stagesOn() {
		return
	}
	now := time.Now()
	if ts := delivery.SourceOf(ctx).Timestamp; !ts.IsZero() {
		g.observeStage(stageRelayedToApplied, now.Sub(ts))
	}
	if !e.OccurredAt.IsZero() {
		g.observeStage(stageOccurredToApplied, now.Sub(e.OccurredAt))
	}
}

// eventFromMetadata reads the envelope fields spans carry, without
// validating them: a message that does not decode still gets its span.
// Each is cut to what a valid event's fits (eventline.MaxIdentifierLength
// bytes) and made valid UTF-8 (an exporter refuses invalid UTF-8, losing
// the spans batched with it).
func eventFromMetadata(md message.Metadata) eventline.Event {
	field := func(k string) string {
		return strings.ToValidUTF8(held.Truncate(md.Get(k), eventline.MaxIdentifierLength), "\uFFFD")
	}
	e := eventline.Event{
		ID: field(eventline.MetaEventID), Type: field(eventline.MetaEventType),
		AggregateType: field(eventline.MetaAggregateType), AggregateID: field(eventline.MetaAggregateID),
	}
	e.AggregateVersion, _ = strconv.ParseInt(md.Get(eventline.MetaAggregateVersion), 10, 64)
	return e
}
