// Package tracingtest records spans in memory for tests and examples, and
// prints a trace as an indented tree.
package tracingtest

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// Recorder is a TracerProvider whose ended spans are kept in memory.
type Recorder struct {
	Provider *sdktrace.TracerProvider
	Exporter *tracetest.InMemoryExporter
}

// NewRecorder returns a Recorder that samples every span and exports it
// synchronously when it ends. Shut it down with Shutdown.
func NewRecorder() *Recorder {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	return &Recorder{Provider: tp, Exporter: exp}
}

// New returns a Recorder shut down when tb ends.
func New(tb testing.TB) *Recorder {
	tb.Helper()
	r := NewRecorder()
	tb.Cleanup(r.Shutdown)
	return r
}

// Shutdown stops the provider.
func (r *Recorder) Shutdown() { _ = r.Provider.Shutdown(context.Background()) }

// Spans returns the spans ended so far, in the order they ended.
func (r *Recorder) Spans() tracetest.SpanStubs { return r.Exporter.GetSpans() }

// Named returns the ended spans called name.
func (r *Recorder) Named(name string) tracetest.SpanStubs {
	return r.where(func(s tracetest.SpanStub) bool { return s.Name == name })
}

// Trace returns the ended spans of trace id.
func (r *Recorder) Trace(id trace.TraceID) tracetest.SpanStubs {
	return r.where(func(s tracetest.SpanStub) bool { return s.SpanContext.TraceID() == id })
}

func (r *Recorder) where(keep func(tracetest.SpanStub) bool) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range r.Spans() {
		if keep(s) {
			out = append(out, s)
		}
	}
	return out
}

// Attr returns the value of attribute key of s, as text, and whether s has it.
func Attr(s tracetest.SpanStub, key string) (string, bool) {
	for _, kv := range s.Attributes {
		if string(kv.Key) == key {
			return kv.Value.Emit(), true
		}
	}
	return "", false
}

// Tree renders spans as an indented tree, children under their parent in
// start order. A span whose parent is not among spans is a root. Each line
// shows the name, kind, duration and attributes (keys in omit left out);
// links and errors get lines of their own.
func Tree(spans tracetest.SpanStubs, omit ...string) string {
	ids := map[trace.SpanID]bool{}
	for _, s := range spans {
		ids[s.SpanContext.SpanID()] = true
	}
	children := map[trace.SpanID][]tracetest.SpanStub{}
	var roots []tracetest.SpanStub
	for _, s := range spans {
		if p := s.Parent.SpanID(); s.Parent.IsValid() && ids[p] {
			children[p] = append(children[p], s)
			continue
		}
		roots = append(roots, s)
	}
	byStart := func(a, b tracetest.SpanStub) int { return a.StartTime.Compare(b.StartTime) }
	slices.SortStableFunc(roots, byStart)
	var b strings.Builder
	var walk func(s tracetest.SpanStub, depth int)
	walk = func(s tracetest.SpanStub, depth int) {
		pad := strings.Repeat("  ", depth)
		fmt.Fprintf(&b, "%s%s [%s] %s", pad, s.Name, s.SpanKind, s.EndTime.Sub(s.StartTime).Round(10*time.Microsecond))
		for _, kv := range s.Attributes {
			if slices.Contains(omit, string(kv.Key)) {
				continue
			}
			fmt.Fprintf(&b, " %s=%s", kv.Key, kv.Value.Emit())
		}
		b.WriteByte('\n')
		if s.Status.Code.String() == "Error" {
			fmt.Fprintf(&b, "%s  ! error: %s\n", pad, s.Status.Description)
		}
		for _, l := range s.Links {
			fmt.Fprintf(&b, "%s  -> link: trace %s span %s\n", pad, l.SpanContext.TraceID(), l.SpanContext.SpanID())
		}
		kids := children[s.SpanContext.SpanID()]
		slices.SortStableFunc(kids, byStart)
		for _, k := range kids {
			walk(k, depth+1)
		}
	}
	for _, r := range roots {
		fmt.Fprintf(&b, "trace %s\n", r.SpanContext.TraceID())
		walk(r, 1)
	}
	return b.String()
}
