package tracing_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
)

// TestNilTracerIsOff: without a provider there is no Tracer, and its
// methods change nothing.
func TestNilTracerIsOff(t *testing.T) {
	tr := tracing.New(nil, nil)
	require.Nil(t, tr)
	require.False(t, tr.Enabled())
	ctx := context.Background()
	md := map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	require.Equal(t, ctx, tr.Extract(ctx, md))
	tr.Inject(ctx, md)
	require.Len(t, md, 1)
	_, ok := tr.LinkTo(md)
	require.False(t, ok)
	allocs := testing.AllocsPerRun(100, func() { _ = tr.Extract(ctx, md); tr.Inject(ctx, md) })
	require.Zero(t, allocs)
}

// TestSendSpanRoundTrip: a send span continues the trace in the row's
// metadata and its context, injected into the record, links back.
func TestSendSpanRoundTrip(t *testing.T) {
	rec := tracingtest.New(t)
	tr := tracing.New(rec.Provider, nil)
	pctx, parent := rec.Provider.Tracer("t").Start(context.Background(), "publish")
	row := map[string]string{}
	tr.Inject(pctx, row)
	parent.End()

	e := eventline.Event{ID: "e1", Type: "order.placed", AggregateType: "order", AggregateID: "o1", AggregateVersion: 3}
	_, span := tr.StartSend(tr.Extract(context.Background(), row), "orders", e, 0)
	record := map[string]string{}
	tr.Inject(trace.ContextWithSpan(context.Background(), span), record)
	tracing.End(span, errors.New("kafka: message too large"))

	sends := rec.Named("send orders")
	require.Len(t, sends, 1)
	require.Equal(t, parent.SpanContext().SpanID(), sends[0].Parent.SpanID())
	link, ok := tr.LinkTo(record)
	require.True(t, ok)
	require.Equal(t, sends[0].SpanContext.SpanID(), link.SpanContext.SpanID())
	tree := tracingtest.Tree(rec.Spans())
	require.Contains(t, tree, "publish [internal]")
	require.Contains(t, tree, "\n    send orders [producer]")
	require.Contains(t, tree, "! error: kafka: message too large")
	require.True(t, strings.HasPrefix(tree, "trace "+parent.SpanContext().TraceID().String()))
}

// TestNilPropagatorFollowsTheGlobal: with no Propagator, a Tracer uses the
// global one once the application set it (as PublishTx does), else W3C.
func TestNilPropagatorFollowsTheGlobal(t *testing.T) {
	rec := tracingtest.New(t)
	ctx, span := rec.Provider.Tracer("t").Start(context.Background(), "s")
	defer span.End()

	md := map[string]string{}
	tracing.New(rec.Provider, nil).Inject(ctx, md)
	require.Contains(t, md, "traceparent", "unset global: W3C")

	otel.SetTextMapPropagator(propagation.Baggage{})
	t.Cleanup(func() { otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator()) })
	md = map[string]string{}
	tracing.New(rec.Provider, nil).Inject(ctx, md)
	require.NotContains(t, md, "traceparent", "the application's global propagator (baggage only) is used")
}
