package tracing_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

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
	require.Nil(t, tr)
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

// TestBoundedText: text for a span attribute is valid UTF-8 of at most n
// bytes, cut on a rune boundary and marked when it was longer; short
// valid text is returned as is.
func TestBoundedText(t *testing.T) {
	t.Parallel()
	require.Equal(t, "short", tracing.BoundedText("short", 16))
	require.Equal(t, "a\uFFFDb", tracing.BoundedText("a\xffb", 16))
	for _, s := range []string{
		strings.Repeat("é", 1000), strings.Repeat("x", 2000), strings.Repeat("\xff", 2000),
		strings.Repeat("a\xff", 1000), strings.Repeat("日本", 500) + "\xe6\x97",
	} {
		for _, n := range []int{4, 5, 16, 17, 255, 1024} {
			got := tracing.BoundedText(s, n)
			require.LessOrEqual(t, len(got), n, "%q cut to %d", s[:8], n)
			require.True(t, utf8.ValidString(got), "%q cut to %d: %q", s[:8], n, got)
			require.True(t, strings.HasSuffix(got, "…"), "%q cut to %d is marked: %q", s[:8], n, got)
		}
	}
}

// TestRetryEvent: the event lands on the recording span of the context,
// its error bounded; on a context without one (tracing off) nothing is
// recorded and nothing is allocated. Not parallel: AllocsPerRun.
func TestRetryEvent(t *testing.T) {
	rec := tracingtest.New(t)
	ctx, span := rec.Provider.Tracer("t").Start(context.Background(), "process orders")
	huge := errors.New(strings.Repeat("\xff日", 1<<20))
	tracing.RetryEvent(ctx, 2, tracing.RetryKindHandler, 1500*time.Millisecond, huge)
	span.End()
	evs := rec.Spans()[0].Events
	require.Len(t, evs, 1)
	require.Equal(t, tracing.EventRetry, evs[0].Name)
	got := map[string]string{}
	for _, kv := range evs[0].Attributes {
		got[string(kv.Key)] = kv.Value.Emit()
	}
	require.Equal(t, "2", got["eventline.retry.attempt"])
	require.Equal(t, "handler", got["eventline.retry.kind"])
	require.Equal(t, "1.5", got["eventline.retry.wait.seconds"])
	require.LessOrEqual(t, len(got["eventline.retry.error"]), tracing.MaxRetryErrorBytes)
	require.True(t, utf8.ValidString(got["eventline.retry.error"]))

	off := context.Background()
	err := errors.New("smtp down")
	require.Zero(t, testing.AllocsPerRun(100, func() {
		tracing.RetryEvent(off, 1, tracing.RetryKindConflict, time.Second, err)
	}), "no allocation without a recording span")
	_, ended := rec.Provider.Tracer("t").Start(context.Background(), "ended")
	ended.End()
	endedCtx := trace.ContextWithSpan(context.Background(), ended)
	require.Zero(t, testing.AllocsPerRun(100, func() {
		tracing.RetryEvent(endedCtx, 1, tracing.RetryKindConflict, time.Second, err)
	}), "no allocation on a span no longer recording")
}
