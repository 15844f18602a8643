package middleware_test

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
	"github.com/eventline/eventline/middleware"
)

const tracedTopic = "orders"

// tracedFixture is the composed middleware with a TracerProvider, behind
// Traced as Chain and the consumer put it; the business handler starts a
// span of its own ("handle <aggregate version>").
func tracedFixture(t *testing.T, cfg middleware.Config) (*fixture, *tracingtest.Recorder) {
	t.Helper()
	rec := tracingtest.New(t)
	cfg.TracerProvider = rec.Provider
	f := newFixture(t, cfg)
	f.observe = func(ctx context.Context, e eventline.Event) {
		_, span := rec.Provider.Tracer("user").Start(ctx, "handle")
		span.End()
	}
	f.handler = f.el.Traced(f.handler)
	return f, rec
}

// sent returns a message for e carrying the context of a new "send" span
// of rec (what the relay writes into the record headers), and that span.
func sent(t *testing.T, rec *tracingtest.Recorder, e eventline.Event) (*message.Message, trace.SpanContext) {
	t.Helper()
	msg := consumertest.Message(t, e)
	ctx, span := rec.Provider.Tracer("relay").Start(context.Background(), "send "+tracedTopic, trace.WithSpanKind(trace.SpanKindProducer))
	tracing.DefaultPropagator().Inject(ctx, propagation.MapCarrier(msg.Metadata))
	span.End()
	return msg, span.SpanContext()
}

func deliverFrom(t *testing.T, f *fixture, msg *message.Message) error {
	t.Helper()
	m := consumertest.Redeliver(msg)
	m.SetContext(delivery.WithSource(context.Background(),
		delivery.Source{Topic: tracedTopic, FromKafka: true, Partition: 2, Offset: 7, Timestamp: time.Now().Add(-time.Second)}))
	_, err := f.handler(m)
	return err
}

func childrenOf(spans tracetest.SpanStubs, parent trace.SpanContext, name string) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range spans {
		if s.Parent.SpanID() == parent.SpanID() && s.SpanContext.TraceID() == parent.TraceID() && (name == "" || s.Name == name) {
			out = append(out, s)
		}
	}
	return out
}

func attr(t *testing.T, s tracetest.SpanStub, key string) string {
	t.Helper()
	v, ok := tracingtest.Attr(s, key)
	require.True(t, ok, "span %q has no attribute %s", s.Name, key)
	return v
}

// TestTraceContinuesIntoTheHandler: the process span continues the
// record's trace (a child of the relay's send span), carries the
// messaging and eventline attributes with outcome applied, and the
// handler's own span nests under it.
func TestTraceContinuesIntoTheHandler(t *testing.T) {
	t.Parallel()
	f, rec := tracedFixture(t, middleware.Config{})
	e := consumertest.Event("a", 1)
	msg, send := sent(t, rec, e)
	require.NoError(t, deliverFrom(t, f, msg))

	procs := childrenOf(rec.Spans(), send, "process "+tracedTopic)
	require.Len(t, procs, 1, "one process span, child of send:\n%s", tracingtest.Tree(rec.Spans()))
	p := procs[0]
	require.Equal(t, trace.SpanKindConsumer, p.SpanKind)
	for k, want := range map[string]string{
		"messaging.system": "kafka", "messaging.destination.name": tracedTopic, "messaging.message.id": msg.UUID,
		"messaging.consumer.group.name": group, "messaging.destination.partition.id": "2", "messaging.kafka.offset": "7",
		"eventline.aggregate.id": "a", "eventline.aggregate.version": "1", "eventline.outcome": "applied",
	} {
		require.Equal(t, want, attr(t, p, k), k)
	}
	require.Len(t, childrenOf(rec.Spans(), p.SpanContext, "handle"), 1, "the handler's span nests under process")
}

// TestTraceOfARedeliveredDuplicate: a redelivery gets its own process
// span in the same trace, outcome duplicate, and the handler does not run.
func TestTraceOfARedeliveredDuplicate(t *testing.T) {
	t.Parallel()
	f, rec := tracedFixture(t, middleware.Config{})
	msg, send := sent(t, rec, consumertest.Event("a", 1))
	require.NoError(t, deliverFrom(t, f, msg))
	require.NoError(t, deliverFrom(t, f, msg))

	procs := childrenOf(rec.Spans(), send, "process "+tracedTopic)
	require.Len(t, procs, 2)
	require.Equal(t, "applied", attr(t, procs[0], "eventline.outcome"))
	require.Equal(t, "duplicate", attr(t, procs[1], "eventline.outcome"))
	require.Empty(t, childrenOf(rec.Spans(), procs[1].SpanContext, ""), "nothing ran for the duplicate")
}

// TestTraceOfAParkedThenReleasedEvent: v2 arrives first and is parked
// (outcome parked, in its own trace); when v1 arrives, v2 is applied under
// a "release" span in v1's process span, linked to v2's trace, and v2's
// handler span nests under the release span.
func TestTraceOfAParkedThenReleasedEvent(t *testing.T) {
	t.Parallel()
	f, rec := tracedFixture(t, middleware.Config{})
	m2, send2 := sent(t, rec, consumertest.Event("a", 2))
	m1, send1 := sent(t, rec, consumertest.Event("a", 1))
	require.NoError(t, deliverFrom(t, f, m2))
	require.NoError(t, deliverFrom(t, f, m1))
	spans := rec.Spans()

	p2 := childrenOf(spans, send2, "process "+tracedTopic)
	require.Len(t, p2, 1)
	require.Equal(t, "parked", attr(t, p2[0], "eventline.outcome"))
	p1 := childrenOf(spans, send1, "process "+tracedTopic)
	require.Len(t, p1, 1)
	require.Equal(t, "applied", attr(t, p1[0], "eventline.outcome"))

	rel := childrenOf(spans, p1[0].SpanContext, "release "+tracedTopic)
	require.Len(t, rel, 1, "the release runs in v1's transaction:\n%s", tracingtest.Tree(spans))
	r := rel[0]
	require.Equal(t, "released", attr(t, r, "eventline.outcome"))
	require.Equal(t, "2", attr(t, r, "eventline.aggregate.version"))
	require.Len(t, r.Links, 1)
	require.Equal(t, send2.TraceID(), r.Links[0].SpanContext.TraceID(), "linked to the trace v2 arrived with")
	require.Equal(t, send2.SpanID(), r.Links[0].SpanContext.SpanID())
	require.Len(t, childrenOf(spans, r.SpanContext, "handle"), 1, "v2's handler span nests under release")
	require.Equal(t, 1.0, f.histCount(t, "eventline_consumer_stage_seconds", "parked_to_released"))
	require.Equal(t, 1.0, f.histCount(t, "eventline_consumer_stage_seconds", "relayed_to_applied"), "only v1 was applied on arrival")
}

// TestTraceOfADeadLetter: a permanent failure under Chain ends as a
// dead_letter span under the process span, whose outcome is dead_lettered.
func TestTraceOfADeadLetter(t *testing.T) {
	t.Parallel()
	f, rec := tracedFixture(t, middleware.Config{MaxRetries: middleware.NoRetries})
	f.fail = func(eventline.Event) error { return middleware.Permanent(errors.New("cannot apply")) }
	f.handler = f.el.Chain("billing", f.business(group))
	msg, send := sent(t, rec, consumertest.Event("a", 1))
	require.NoError(t, deliverFrom(t, f, msg), "dead-lettered and acknowledged")

	procs := childrenOf(rec.Spans(), send, "process "+tracedTopic)
	require.Len(t, procs, 1, "one process span per delivery, around dead-lettering and retries:\n%s", tracingtest.Tree(rec.Spans()))
	require.Equal(t, "dead_lettered", attr(t, procs[0], "eventline.outcome"))
	dl := childrenOf(rec.Spans(), procs[0].SpanContext, "dead_letter "+tracedTopic)
	require.Len(t, dl, 1)
	require.Equal(t, "permanent", attr(t, dl[0], "eventline.dead_letter.kind"))
}

// TestNoTracerProviderNoSpans: without a TracerProvider nothing is traced,
// even with a global-looking span context in the record, and Traced
// returns the handler itself.
func TestNoTracerProviderNoSpans(t *testing.T) {
	t.Parallel()
	rec := tracingtest.New(t)
	f := newFixture(t, middleware.Config{})
	f.handler = f.el.Traced(f.el.MiddlewareFor("test")(f.business(group)))
	msg, _ := sent(t, rec, consumertest.Event("a", 1))
	require.NoError(t, deliverFrom(t, f, msg))
	require.Len(t, rec.Spans(), 1, "only the test's send span")
	h := f.business(group)
	require.Equal(t, funcPtr(h), funcPtr(f.el.Traced(h)), "Traced is the identity when off")
}

// TestStageHistogramsInOTel: with a MeterProvider, stage latencies are
// also recorded as eventline.stage.duration.
func TestStageHistogramsInOTel(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	f, rec := tracedFixture(t, middleware.Config{MeterProvider: mp})
	msg, _ := sent(t, rec, consumertest.Event("a", 1))
	require.NoError(t, deliverFrom(t, f, msg))

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	counts := map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "eventline.stage.duration" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
				stage, _ := dp.Attributes.Value("eventline.stage")
				counts[stage.AsString()] += dp.Count
			}
		}
	}
	require.Equal(t, map[string]uint64{"relayed_to_applied": 1, "occurred_to_applied": 1}, counts)
	require.Equal(t, 1.0, f.histCount(t, "eventline_consumer_stage_seconds", "relayed_to_applied"))
}

// histCount is the sample count of a histogram's series with stage.
func (f *fixture) histCount(t *testing.T, name, stage string) float64 {
	t.Helper()
	families, err := f.registry.Gather()
	require.NoError(t, err)
	for _, fam := range families {
		if fam.GetName() != name {
			continue
		}
		for _, m := range fam.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "stage" && l.GetValue() == stage {
					return float64(m.GetHistogram().GetSampleCount())
				}
			}
		}
	}
	return 0
}

func funcPtr(h message.HandlerFunc) uintptr { return reflect.ValueOf(h).Pointer() }

// TestTraceOfAParkedEventReleasedBySweeper: released by the sweeper (the
// gap was given up on), the parked event's "release" span starts a trace
// of its own, linked to the one it arrived with.
func TestTraceOfAParkedEventReleasedBySweeper(t *testing.T) {
	t.Parallel()
	f, rec := tracedFixture(t, middleware.Config{ParkTimeout: time.Hour})
	m1, _ := sent(t, rec, consumertest.Event("a", 1))
	m3, send3 := sent(t, rec, consumertest.Event("a", 3))
	require.NoError(t, deliverFrom(t, f, m1))
	require.NoError(t, deliverFrom(t, f, m3))
	ctx := context.Background()
	_, err := f.el.Store().ReleaseGap(ctx, f.env.Pool, group, "thing", "a", "v2 was lost upstream")
	require.NoError(t, err)
	res, err := f.el.SweepResult(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Released, "%+v", res)

	rel := rec.Named("release " + tracedTopic)
	require.Len(t, rel, 1, "%s", tracingtest.Tree(rec.Spans()))
	r := rel[0]
	require.False(t, r.Parent.IsValid(), "the sweeper's release is a root")
	require.Len(t, r.Links, 1)
	require.Equal(t, send3.TraceID(), r.Links[0].SpanContext.TraceID())
	require.Equal(t, "released", attr(t, r, "eventline.outcome"))
	require.Len(t, childrenOf(rec.Spans(), r.SpanContext, "handle"), 1)
	require.Equal(t, 1.0, f.histCount(t, "eventline_consumer_stage_seconds", "parked_to_released"))
}
