package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
)

// TestConsumerContinuesTheRecordsTrace: over Kafka, each delivery gets a
// "process" span continuing the trace in the record's headers, the
// handler's span nests under it; a record delivered twice is a duplicate
// in the same trace; an event parked and released later gets a "release"
// span linked to the trace it arrived with.
func TestConsumerContinuesTheRecordsTrace(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "traced"
	rec := tracingtest.New(t)
	cfg := k.config(group)
	cfg.TracerProvider = rec.Provider
	reg := withMetrics(t, &cfg)
	c := k.newConsumer(t, cfg)
	apply := k.applyHandler(group)
	require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		_, span := rec.Provider.Tracer("user").Start(ctx, "handle")
		defer span.End()
		return apply(ctx, tx, e)
	}))

	// As the relay writes them: each record carries its send span.
	send := func(e eventline.Event) (*message.Message, trace.SpanContext) {
		msg := consumertest.Message(t, e)
		ctx, span := rec.Provider.Tracer("relay").Start(context.Background(), "send "+k.topic, trace.WithSpanKind(trace.SpanKindProducer))
		tracing.DefaultPropagator().Inject(ctx, propagation.MapCarrier(msg.Metadata))
		span.End()
		return msg, span.SpanContext()
	}
	a1, sendA1 := send(consumertest.Event("a", 1))
	b2, sendB2 := send(consumertest.Event("b", 2))
	b1, sendB1 := send(consumertest.Event("b", 1))
	publish(t, k.brokers, k.topic, a1, consumertest.Redeliver(a1), b2, b1)
	r := start(t, c)
	name := "process " + k.topic
	eventually(t, 60*time.Second, func() bool { return len(rec.Named(name)) >= 4 && len(rec.Named("release "+k.topic)) >= 1 }, "four process spans and a release")
	require.NoError(t, r.stop())
	spans := rec.Spans()
	tree := tracingtest.Tree(spans)

	under := func(parent trace.SpanContext, name string) tracetest.SpanStubs {
		var out tracetest.SpanStubs
		for _, s := range spans {
			if s.Parent.SpanID() == parent.SpanID() && s.SpanContext.TraceID() == parent.TraceID() && s.Name == name {
				out = append(out, s)
			}
		}
		return out
	}
	outcome := func(s tracetest.SpanStub) string { v, _ := tracingtest.Attr(s, "eventline.outcome"); return v }

	pa := under(sendA1, name)
	require.Len(t, pa, 2, "the record and its redelivery:\n%s", tree)
	require.ElementsMatch(t, []string{"applied", "duplicate"}, []string{outcome(pa[0]), outcome(pa[1])})
	if outcome(pa[0]) != "applied" {
		pa[0], pa[1] = pa[1], pa[0]
	}
	require.Len(t, under(pa[0].SpanContext, "handle"), 1, "the handler's span nests under process:\n%s", tree)
	require.Empty(t, under(pa[1].SpanContext, "handle"), "no handler ran for the duplicate")
	gotGroup, _ := tracingtest.Attr(pa[0], "messaging.consumer.group.name")
	require.Equal(t, group, gotGroup)

	pb2 := under(sendB2, name)
	require.Len(t, pb2, 1)
	require.Equal(t, "parked", outcome(pb2[0]))
	pb1 := under(sendB1, name)
	require.Len(t, pb1, 1)
	rel := under(pb1[0].SpanContext, "release "+k.topic)
	require.Len(t, rel, 1, "b2 released in b1's transaction:\n%s", tree)
	require.Len(t, rel[0].Links, 1)
	require.Equal(t, sendB2.TraceID(), rel[0].Links[0].SpanContext.TraceID(), "linked to b2's own trace")
	require.Len(t, under(rel[0].SpanContext, "handle"), 1)

	// The stage histograms: a1 and b1 applied on arrival, b2 released.
	stages := metrictest.SumByLabel(t, reg, "eventline_consumer_stage_seconds", "stage")
	require.Equal(t, map[string]float64{"relayed_to_applied": 2, "occurred_to_applied": 2, "parked_to_released": 1}, stages)
}
