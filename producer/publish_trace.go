package producer

import (
	"context"
	"maps"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/eventline/eventline"
)

// traceHeaders returns the caller's trace context as the propagator writes
// it (for the W3C propagators: traceparent, tracestate and baggage), or nil
// when ctx carries neither a valid span context nor baggage, in which case
// the propagator is not called at all.
func (p *Producer) traceHeaders(ctx context.Context) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() && baggage.FromContext(ctx).Len() == 0 {
		return nil
	}
	prop := p.cfg.Propagator
	if prop == nil {
		prop = otel.GetTextMapPropagator()
	}
	carrier := propagation.MapCarrier{}
	prop.Inject(ctx, carrier)
	if len(carrier) == 0 {
		return nil
	}
	return carrier
}

// withTrace returns e carrying the trace headers: traceparent in
// TraceParent, every other header in Metadata unless the caller set that
// key already. The caller's Metadata map is copied, never modified.
func withTrace(e eventline.Event, headers map[string]string) eventline.Event {
	md := e.Metadata
	copied := false
	for k, v := range headers {
		if k == eventline.MetaTraceParent {
			e.TraceParent = v
			continue
		}
		if _, set := md[k]; set {
			continue
		}
		if !copied {
			md = make(map[string]string, len(e.Metadata)+len(headers))
			maps.Copy(md, e.Metadata)
			copied = true
		}
		md[k] = v
	}
	e.Metadata = md
	return e
}
