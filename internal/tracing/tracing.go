// Package tracing is eventline's OpenTelemetry plumbing: the relay's send
// spans, the consumer's process, release and dead_letter spans, and the
// attributes they carry. A nil *Tracer is tracing turned off: every method
// is then a no-op that allocates nothing, so a component configured
// without a TracerProvider pays one nil check per event.
package tracing

import (
	"context"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/delivery"
)

// ScopeName is the instrumentation scope of eventline's spans and metrics.
const ScopeName = "github.com/eventline/eventline"

// Attribute keys: OpenTelemetry's messaging semantic conventions, and
// eventline's own.
const (
	AttrMessagingSystem    = attribute.Key("messaging.system")
	AttrOperationType      = attribute.Key("messaging.operation.type")
	AttrOperationName      = attribute.Key("messaging.operation.name")
	AttrDestination        = attribute.Key("messaging.destination.name")
	AttrMessageID          = attribute.Key("messaging.message.id")
	AttrPartition          = attribute.Key("messaging.destination.partition.id")
	AttrOffset             = attribute.Key("messaging.kafka.offset")
	AttrKey                = attribute.Key("messaging.kafka.message.key")
	AttrConsumerGroup      = attribute.Key("messaging.consumer.group.name")
	AttrEventType          = attribute.Key("eventline.event.type")
	AttrAggregateType      = attribute.Key("eventline.aggregate.type")
	AttrAggregateID        = attribute.Key("eventline.aggregate.id")
	AttrAggregateVersion   = attribute.Key("eventline.aggregate.version")
	AttrOutcome            = attribute.Key("eventline.outcome")
	AttrLate               = attribute.Key("eventline.late")
	AttrDeadLetterReason   = attribute.Key("eventline.dead_letter.kind")
	AttrRelayShard         = attribute.Key("eventline.relay.shard")
	AttrParkedSeconds      = attribute.Key("eventline.parked.seconds")
	messagingSystemKafka   = "kafka"
	operationSend          = "send"
	operationProcess       = "process"
	operationSettle        = "settle"
	operationNameRelease   = "release"
	operationNameDeadLeter = "dead_letter"
)

// Outcomes, the values of eventline.outcome on a process span: what the
// consumer did with the event.
const (
	OutcomeApplied      = "applied"
	OutcomeDuplicate    = "duplicate"
	OutcomeStale        = "stale"
	OutcomeParked       = "parked"
	OutcomeReleased     = "released"
	OutcomeSkipped      = "skipped"
	OutcomeDeadLettered = "dead_lettered"
)

// The span event middleware.Retry adds to the span of the message's
// context (the process span) at each retry it schedules: which attempt
// failed (1 for the first), why it is retried (a RetryKind…), how long it
// waits before the next attempt, and the attempt's error, cut to
// MaxRetryErrorBytes and made valid UTF-8.
const (
	EventRetry       = "eventline.retry"
	AttrRetryAttempt = attribute.Key("eventline.retry.attempt")
	AttrRetryKind    = attribute.Key("eventline.retry.kind")
	AttrRetryWait    = attribute.Key("eventline.retry.wait.seconds")
	AttrRetryError   = attribute.Key("eventline.retry.error")

	// RetryKindHandler: the handler failed; the retry spends the budget.
	RetryKindHandler = "handler"
	// RetryKindConflict: a transaction conflict (serialization failure,
	// deadlock); retried without spending the budget.
	RetryKindConflict = "conflict"
	// RetryKindInfrastructure: the database is unavailable; the event
	// waits for it.
	RetryKindInfrastructure = "infrastructure"
	// RetryKindUnsafeComposition: the middleware chain is composed
	// unsafely; the event waits for a fixed deployment.
	RetryKindUnsafeComposition = "unsafe_composition"

	// MaxRetryErrorBytes bounds eventline.retry.error.
	MaxRetryErrorBytes = 1024
)

// RetryEvent adds an eventline.retry event to the span in ctx. When that
// span is not recording (tracing off, or not sampled) it does nothing and
// allocates nothing.
func RetryEvent(ctx context.Context, attempt int, kind string, wait time.Duration, err error) {
	sp := trace.SpanFromContext(ctx)
	if !sp.IsRecording() {
		return
	}
	text := ""
	if err != nil {
		text = BoundedText(err.Error(), MaxRetryErrorBytes)
	}
	sp.AddEvent(EventRetry, trace.WithAttributes(AttrRetryAttempt.Int(attempt), AttrRetryKind.String(kind),
		AttrRetryWait.Float64(wait.Seconds()), AttrRetryError.String(text)))
}

// cutMark marks text BoundedText cut.
const cutMark = "…"

// BoundedText returns s as valid UTF-8 (invalid bytes become U+FFFD) of at
// most n bytes (n ≥ 4): cut on a rune boundary and ended with "…" when it
// was longer. An exporter refuses invalid UTF-8 (losing the spans batched
// with it), and a collector may drop a huge attribute.
func BoundedText(s string, n int) string {
	if len(s) <= n && utf8.ValidString(s) {
		return s
	}
	cut := len(s) > n
	if cut {
		s = s[:n] // bounds the work below
		// Drop a rune the cut split, rather than replace it.
		j := len(s) - 1
		for j > 0 && len(s)-j < utf8.UTFMax && !utf8.RuneStart(s[j]) {
			j--
		}
		if !utf8.FullRuneInString(s[j:]) {
			s = s[:j]
		}
	}
	s = strings.ToValidUTF8(s, "\uFFFD")
	if !cut && len(s) <= n {
		return s
	}
	if limit := n - len(cutMark); len(s) > limit {
		for limit > 0 && !utf8.RuneStart(s[limit]) {
			limit--
		}
		s = s[:limit]
	}
	return s + cutMark
}

// Tracer makes eventline's spans. The zero of a *Tracer, nil, is off.
type Tracer struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
}

// DefaultPropagator is the propagator a Tracer uses when given none: W3C
// trace context and baggage, the headers PublishTx captures.
func DefaultPropagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// New returns a Tracer making spans with tp and carrying context through
// message metadata with prop. When prop is nil it uses OpenTelemetry's
// global propagator if the application set one (so the relay and the
// consumers read what PublishTx wrote with it), else DefaultPropagator.
// It returns nil, tracing off, when tp is nil.
func New(tp trace.TracerProvider, prop propagation.TextMapPropagator) *Tracer {
	if tp == nil {
		return nil
	}
	if prop == nil {
		prop = DefaultPropagator()
		if g := otel.GetTextMapPropagator(); len(g.Fields()) > 0 {
			prop = g
		}
	}
	return &Tracer{tracer: tp.Tracer(ScopeName), prop: prop}
}

// Extract returns ctx carrying the trace context and baggage found in md
// (message metadata, Kafka headers), or ctx unchanged when tracing is off.
func (t *Tracer) Extract(ctx context.Context, md map[string]string) context.Context {
	if t == nil || len(md) == 0 {
		return ctx
	}
	return t.prop.Extract(ctx, propagation.MapCarrier(md))
}

// Inject writes ctx's trace context and baggage into md.
func (t *Tracer) Inject(ctx context.Context, md map[string]string) {
	if t == nil || md == nil {
		return
	}
	t.prop.Inject(ctx, propagation.MapCarrier(md))
}

// LinkTo returns a link to the span whose context md carries, and false
// when it carries none.
func (t *Tracer) LinkTo(md map[string]string) (trace.Link, bool) {
	if t == nil {
		return trace.Link{}, false
	}
	sc := trace.SpanContextFromContext(t.prop.Extract(context.Background(), propagation.MapCarrier(md)))
	if !sc.IsValid() {
		return trace.Link{}, false
	}
	return trace.Link{SpanContext: sc}, true
}

// StartSend starts the relay's producer span for one event: "send <topic>",
// a child of the publishing span in ctx.
func (t *Tracer) StartSend(ctx context.Context, topic string, e eventline.Event, shard int) (context.Context, trace.Span) {
	attrs := append(eventAttrs(topic, e, 12),
		AttrOperationType.String(operationSend), AttrOperationName.String(operationSend),
		AttrKey.String(e.AggregateID), AttrRelayShard.Int(shard))
	return t.tracer.Start(ctx, "send "+topic, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
}

// StartProcess starts the consumer group's span for one delivery of the
// record src locates: "process <topic>", continuing the trace in ctx
// (extracted from the record).
func (t *Tracer) StartProcess(ctx context.Context, src delivery.Source, group string, e eventline.Event) (context.Context, trace.Span) {
	attrs := append(eventAttrs(src.Topic, e, 12), AttrOperationType.String(operationProcess), AttrOperationName.String(operationProcess),
		AttrConsumerGroup.String(group))
	if src.FromKafka {
		attrs = append(attrs, AttrPartition.String(strconv.Itoa(int(src.Partition))), AttrOffset.Int64(src.Offset))
	}
	return t.tracer.Start(ctx, "process "+src.Topic, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
}

// StartRelease starts the span of a parked event applied after it waited:
// "release <topic>", a child of ctx's span (the process span of the event
// that filled the gap, or none for the sweeper), linked to the trace the
// event arrived with (the span whose context md carries, if any).
func (t *Tracer) StartRelease(ctx context.Context, topic, group string, e eventline.Event, md map[string]string) (context.Context, trace.Span) {
	attrs := append(eventAttrs(topic, e, 10), AttrOperationType.String(operationSettle), AttrOperationName.String(operationNameRelease),
		AttrConsumerGroup.String(group), AttrOutcome.String(OutcomeReleased))
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...)}
	if link, ok := t.LinkTo(md); ok {
		opts = append(opts, trace.WithLinks(link))
	}
	return t.tracer.Start(ctx, "release "+topic, opts...)
}

// StartDeadLetter starts the span of a message being dead-lettered:
// "dead_letter <topic>", a child of ctx's span.
func (t *Tracer) StartDeadLetter(ctx context.Context, topic, group, kind string, e eventline.Event) (context.Context, trace.Span) {
	attrs := append(eventAttrs(topic, e, 10), AttrOperationType.String(operationSettle), AttrOperationName.String(operationNameDeadLeter),
		AttrConsumerGroup.String(group), AttrDeadLetterReason.String(kind))
	return t.tracer.Start(ctx, "dead_letter "+topic, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...))
}

// eventAttrs are the attributes every eventline span carries for e.
func eventAttrs(topic string, e eventline.Event, capacity int) []attribute.KeyValue {
	attrs := make([]attribute.KeyValue, 0, capacity)
	attrs = append(attrs, AttrMessagingSystem.String(messagingSystemKafka), AttrDestination.String(topic))
	if e.ID != "" {
		attrs = append(attrs, AttrMessageID.String(e.ID))
	}
	if e.Type != "" {
		attrs = append(attrs, AttrEventType.String(e.Type))
	}
	if e.AggregateType != "" {
		attrs = append(attrs, AttrAggregateType.String(e.AggregateType), AttrAggregateID.String(e.AggregateID))
	}
	if e.AggregateVersion > 0 {
		attrs = append(attrs, AttrAggregateVersion.Int64(e.AggregateVersion))
	}
	return attrs
}

// End ends span, recording err (if any) as its error status.
func End(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
