package middleware_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
)

// The tracing benchmarks measure what tracing costs the consumer, off (no
// TracerProvider: the default) and on (the OTel SDK sampling every span,
// batching them to an exporter that drops them):
//
//	go test -run '^$' -bench 'BenchmarkTracing' -benchmem -benchtime 3s ./middleware/
//
// BenchmarkTracingMiddleware is BenchmarkMiddleware (a transaction and a
// business insert per event, on PostgreSQL) behind Traced, as Chain and
// the consumer compose it; BenchmarkTracingWrapper is the tracing alone,
// around a handler that does nothing, where its cost is not hidden by the
// database's.

// benchTraceparent is the context the relay's send span writes into each
// record.
const benchTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func benchProviders(b *testing.B) map[string]trace.TracerProvider {
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(tracetest.NewNoopExporter()), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return map[string]trace.TracerProvider{"off": nil, "sdk": tp}
}

func BenchmarkTracingMiddleware(b *testing.B) {
	for _, mode := range []string{"off", "sdk"} {
		b.Run(mode, func(b *testing.B) {
			be := newBenchEnv(b)
			be.traceParent = benchTraceparent
			el, mw := be.eventline(b, benchProviders(b)[mode])
			h := el.Traced(mw)
			b.ReportAllocs()
			be.run(b, 1, func(msgs []*message.Message) error {
				_, err := h(msgs[0])
				return err
			})
		})
	}
}

func BenchmarkTracingWrapper(b *testing.B) {
	for _, mode := range []string{"off", "sdk"} {
		b.Run(mode, func(b *testing.B) {
			be := newBenchEnv(b)
			el, _ := be.eventline(b, benchProviders(b)[mode])
			h := el.Traced(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			e := benchEvents(1)()
			e.TraceParent = benchTraceparent
			msg, err := eventline.Encode(e)
			require.NoError(b, err)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := h(msg); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
