package producer_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/tracing"
	"github.com/eventline/eventline/internal/tracing/tracingtest"
	"github.com/eventline/eventline/producer"
)

// publishTraced publishes e inside a "place order" span of rec and
// returns that span's context.
func publishTraced(t *testing.T, env pgtest.Env, rec *tracingtest.Recorder, topic string, e eventline.Event) trace.SpanContext {
	t.Helper()
	p, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic, Propagator: tracing.DefaultPropagator()})
	require.NoError(t, err)
	ctx, span := rec.Provider.Tracer("test").Start(context.Background(), "place order")
	require.NoError(t, p.Publish(ctx, env.Pool, e))
	span.End()
	return span.SpanContext()
}

// waitSpans waits until rec has ended n spans called name.
func waitSpans(t *testing.T, rec *tracingtest.Recorder, name string, n int) []tracingtestSpan {
	t.Helper()
	require.Eventually(t, func() bool { return len(rec.Named(name)) >= n }, 30*time.Second, 10*time.Millisecond, "no %q span ended", name)
	return rec.Named(name)
}

type tracingtestSpan = tracetest.SpanStub

// traceSetup gives a relay test a one-shard outbox, a one-partition topic
// on in-process Kafka and an in-memory span recorder.
func traceSetup(t *testing.T) (pgtest.Env, []string, string, *tracingtest.Recorder) {
	t.Helper()
	env, brokers, topic := relaytest.Setup(t, pgtest.Options{Shards: 1, MaxConns: 6}, 1)
	return env, brokers, topic, tracingtest.New(t)
}

// TestRelaySendSpanContinuesThePublishTrace: with a TracerProvider, the
// relay records "send <topic>" (producer kind) as a child of the span
// PublishTx captured, with the messaging and eventline attributes, and
// the Kafka record carries the send span's traceparent.
func TestRelaySendSpanContinuesThePublishTrace(t *testing.T) {
	t.Parallel()
	env, brokers, topic, rec := traceSetup(t)

	e, err := eventline.NewJSONEvent("order.placed", "order", "o-1", map[string]int{"qty": 1})
	require.NoError(t, err)
	e.ID = eventline.NewEventID()
	parent := publishTraced(t, env, rec, topic, e)
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, TracerProvider: rec.Provider})

	var headers map[string]string
	kafkatest.Consume(t, brokers, topic, 30*time.Second, func(m *sarama.ConsumerMessage) bool {
		headers = map[string]string{}
		for _, h := range m.Headers {
			headers[string(h.Key)] = string(h.Value)
		}
		return true
	})
	sends := waitSpans(t, rec, "send "+topic, 1)
	s := sends[0]
	require.Equal(t, trace.SpanKindProducer, s.SpanKind)
	require.Equal(t, parent.TraceID(), s.SpanContext.TraceID(), "one trace from publish to send")
	require.Equal(t, parent.SpanID(), s.Parent.SpanID(), "send is a child of the publishing span")
	for k, want := range map[string]string{
		"messaging.system": "kafka", "messaging.destination.name": topic, "messaging.message.id": e.ID,
		"messaging.operation.type": "send", "messaging.destination.partition.id": "0", "messaging.kafka.offset": "0",
		"eventline.aggregate.type": "order", "eventline.aggregate.id": "o-1", "eventline.aggregate.version": "1",
	} {
		got, ok := tracingtest.Attr(s, k)
		require.True(t, ok, "attribute %s missing", k)
		require.Equal(t, want, got, "attribute %s", k)
	}
	require.Contains(t, headers[eventline.MetaTraceParent], s.SpanContext.SpanID().String(),
		"the record carries the send span's context for the consumer to continue")
	require.True(t, strings.HasPrefix(headers[eventline.MetaTraceParent], "00-"+parent.TraceID().String()))
}

// TestRelaySendSpanRecordsKafkaError: a record Kafka's producer refuses
// (larger than MaxMessageBytes) ends its send span with an error status
// and the error recorded.
func TestRelaySendSpanRecordsKafkaError(t *testing.T) {
	t.Parallel()
	env, brokers, topic, rec := traceSetup(t)

	e, err := eventline.NewJSONEvent("order.placed", "order", "o-big", map[string]string{"blob": strings.Repeat("x", 4000)})
	require.NoError(t, err)
	publishTraced(t, env, rec, topic, e)
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers, TracerProvider: rec.Provider, MaxMessageBytes: 2048, MaxAttempts: 1})

	s := waitSpans(t, rec, "send "+topic, 1)[0]
	require.Equal(t, codes.Error, s.Status.Code, "Kafka's refusal is the span's status")
	require.NotEmpty(t, s.Events, "the error is recorded as an exception event")
	require.Equal(t, "exception", s.Events[0].Name)
}

// TestRelayWithoutTracerProviderLeavesTheTraceparent: tracing off, the
// record carries the publisher's traceparent as it was stored.
func TestRelayWithoutTracerProviderLeavesTheTraceparent(t *testing.T) {
	t.Parallel()
	env, brokers, topic, rec := traceSetup(t)

	e, err := eventline.NewJSONEvent("order.placed", "order", "o-2", map[string]int{"qty": 1})
	require.NoError(t, err)
	parent := publishTraced(t, env, rec, topic, e)
	relaytest.Start(t, env, producer.RelayConfig{Brokers: brokers})
	var tp string
	kafkatest.Consume(t, brokers, topic, 30*time.Second, func(m *sarama.ConsumerMessage) bool {
		for _, h := range m.Headers {
			if string(h.Key) == eventline.MetaTraceParent {
				tp = string(h.Value)
			}
		}
		return true
	})
	require.Contains(t, tp, parent.SpanID().String())
	require.Len(t, rec.Spans(), 1, "only the test's own span: the relay made none")
}
