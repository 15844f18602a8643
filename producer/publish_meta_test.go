package producer_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/producer"
)

// TestPublishTxStampsDeclaredSchemaVersion: events of a declared type get
// the declared payload schema version unless they carry one; a version
// above the declared one is refused before any SQL.
func TestPublishTxStampsDeclaredSchemaVersion(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	declared := map[string]int{"order.created": 3}
	p := newProducerWith(t, env, producer.Config{SchemaVersions: declared})
	declared["order.created"] = 9 // the producer keeps its own copy
	ctx := context.Background()

	older := orderEvent(t, "a")
	older.SchemaVersion = 2
	other := eventline.Event{Type: "order.noted", AggregateType: "order", AggregateID: "a", Payload: []byte(`{}`)}
	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), older, other)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []int{3, 2, 1}, []int{written[0].SchemaVersion, written[1].SchemaVersion, written[2].SchemaVersion})
	for i, want := range []int{3, 2, 1} {
		stored, md := storedEvent(t, env, written[i].ID)
		require.Equal(t, want, stored.SchemaVersion)
		require.Equal(t, []string{"3", "2", "1"}[i], md[eventline.MetaEventVersion])
	}

	newer := orderEvent(t, "a")
	newer.SchemaVersion = 4
	err = p.PublishTx(ctx, closedTx(t, env), orderEvent(t, "a"), newer)
	require.ErrorIs(t, err, producer.ErrSchemaVersion)
	var sv *producer.SchemaVersionError
	require.ErrorAs(t, err, &sv)
	require.Equal(t, producer.SchemaVersionError{Index: 1, EventType: "order.created", Version: 4, Declared: 3}, *sv)
}

// inMemoryTracer returns a tracer recording into an in-memory exporter.
func inMemoryTracer(t *testing.T) trace.Tracer {
	t.Helper()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewInMemoryExporter()))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp.Tracer("eventline-test")
}

var w3c = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// TestPublishTxCapturesTheCallersTraceContext: the span and baggage in
// PublishTx's context are written into the stored row (W3C traceparent,
// tracestate and baggage), where the relay and the consumers find them.
func TestPublishTxCapturesTheCallersTraceContext(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducerWith(t, env, producer.Config{Propagator: w3c})

	ts, err := trace.ParseTraceState("vendor=abc")
	require.NoError(t, err)
	parent := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5}, TraceFlags: trace.FlagsSampled, TraceState: ts, Remote: true,
	})
	ctx := trace.ContextWithRemoteSpanContext(context.Background(), parent)
	member, err := baggage.NewMember("tenant", "acme")
	require.NoError(t, err)
	bag, err := baggage.New(member)
	require.NoError(t, err)
	ctx = baggage.ContextWithBaggage(ctx, bag)
	ctx, span := inMemoryTracer(t).Start(ctx, "place order")
	defer span.End()
	sc := span.SpanContext()
	wantParent := "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"

	own := orderEvent(t, "b")
	own.TraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	keeps := orderEvent(t, "c")
	keeps.Metadata = map[string]string{"baggage": "mine=1"}
	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(ctx, tx, orderEvent(t, "a"), own, keeps, orderEvent(t, "d"))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.NotContains(t, keeps.Metadata, "tracestate", "the caller's metadata map is not modified")

	stored, md := storedEvent(t, env, written[0].ID)
	require.Equal(t, wantParent, stored.TraceParent)
	require.Equal(t, wantParent, md[eventline.MetaTraceParent])
	require.Equal(t, "tenant=acme", md["baggage"])
	require.Equal(t, "vendor=abc", md["tracestate"])
	require.Equal(t, map[string]string{"baggage": "tenant=acme", "tracestate": "vendor=abc"}, stored.Metadata)
	require.Equal(t, written[0].TraceParent, stored.TraceParent, "PublishTxReturning shows it")

	stored, md = storedEvent(t, env, written[1].ID)
	require.Equal(t, own.TraceParent, stored.TraceParent, "an event with its own trace context keeps it")
	require.NotContains(t, md, "baggage")

	stored, _ = storedEvent(t, env, written[2].ID)
	require.Equal(t, wantParent, stored.TraceParent)
	require.Equal(t, "mine=1", stored.Metadata["baggage"], "metadata the caller set wins")

	// The multi-event and the one-event write paths both carry it.
	written, err = p.PublishTxReturning(ctx, mustTx(t, env), orderEvent(t, "e"))
	require.NoError(t, err)
	require.Equal(t, wantParent, written[0].TraceParent)
}

// TestPublishTxWithoutSpanAddsNothing: no span, no baggage: the event is
// stored without trace headers (and the propagator is never called).
func TestPublishTxWithoutSpanAddsNothing(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{})
	p := newProducerWith(t, env, producer.Config{Propagator: panickingPropagator{}})
	tx := mustTx(t, env)
	written, err := p.PublishTxReturning(context.Background(), tx, orderEvent(t, "a"))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(context.Background()))
	stored, md := storedEvent(t, env, written[0].ID)
	require.Empty(t, stored.TraceParent)
	require.NotContains(t, md, eventline.MetaTraceParent)
	require.NotContains(t, md, "baggage")
}

type panickingPropagator struct{ propagation.TextMapPropagator }

func (panickingPropagator) Inject(context.Context, propagation.TextMapCarrier) {
	panic("the propagator must not be called without a span or baggage")
}

// TestPublishTxUsesTheGlobalPropagatorByDefault (not parallel: it sets
// OpenTelemetry's global propagator).
func TestPublishTxUsesTheGlobalPropagatorByDefault(t *testing.T) {
	env := pgtest.New(t, pgtest.Options{})
	p := newProducer(t, env)
	ctx, span := inMemoryTracer(t).Start(context.Background(), "work")
	defer span.End()

	// OpenTelemetry's own default propagates nothing. Once a process set a
	// global propagator it cannot be unset (restoring the previous one
	// keeps the delegate), so with -count>1 the global writes headers by
	// now: PublishTx must then write just what the global writes.
	carrier := propagation.MapCarrier{}
	otel.GetTextMapPropagator().Inject(ctx, carrier)
	written, err := p.PublishTxReturning(ctx, mustTx(t, env), orderEvent(t, "a"))
	require.NoError(t, err)
	require.Equal(t, carrier.Get("traceparent"), written[0].TraceParent)

	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(w3c)
	t.Cleanup(func() { otel.SetTextMapPropagator(prev) })
	written, err = p.PublishTxReturning(ctx, mustTx(t, env), orderEvent(t, "b"))
	require.NoError(t, err)
	require.Contains(t, written[0].TraceParent, span.SpanContext().TraceID().String())
}
