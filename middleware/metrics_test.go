package middleware_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/middleware"
)

// Event types come from the wire: a producer sending random types must not
// create a Prometheus series per type. Registered types keep their label,
// the first MaxUnregisteredEventTypes others too, the rest count as
// "other". Before: 300 random types made 300 series per metric.
func TestMetricLabelsAreBounded(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	f.metrics.RegisterEventTypes("thing.changed")
	const n = 300
	for i := 0; i < n; i++ {
		e := consumertest.Event(fmt.Sprintf("a%d", i), 1)
		e.Type = fmt.Sprintf("random.%d", i)
		require.NoError(t, f.deliver(t, consumertest.Message(t, e)))
	}
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("z", 1))))

	labels := metrictest.SumByLabel(t, f.registry, "eventline_consumer_events_applied_total", "event_type")
	require.Len(t, labels, middleware.MaxUnregisteredEventTypes+2, "the first unregistered types, thing.changed and other")
	require.Equal(t, 1.0, labels["thing.changed"], "a registered type keeps its label")
	require.Equal(t, float64(n-middleware.MaxUnregisteredEventTypes), labels[middleware.OtherEventType])
	require.Equal(t, float64(n+1), f.metric(t, "eventline_consumer_events_applied_total"), "every event is still counted")
}

// TestGapDurationIsObservedByOutcome: a gap the missing version fills, one
// the sweeper skips after the park timeout and one an operator releases
// are each observed once in eventline_consumer_gap_duration_seconds with
// their outcome. Before: no such metric (every count was 0).
func TestGapDurationIsObservedByOutcome(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{ParkTimeout: time.Nanosecond})
	deliver := func(id string, v int64) {
		t.Helper()
		require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event(id, v))))
	}
	deliver("a", 1)
	deliver("a", 3)
	deliver("a", 2) // fills a's gap
	require.Equal(t, map[string]float64{"filled": 1}, metrictest.SumByLabel(t, f.registry, "eventline_consumer_gap_duration_seconds", "outcome"))
	require.Equal(t, []int64{1, 2, 3}, f.versions(t, "a"))

	deliver("b", 2) // b1 never comes: skipped by the sweeper
	deliver("c", 1)
	deliver("c", 3) // c2 never comes: released by an operator
	_, err := f.el.Store().ReleaseGap(context.Background(), f.env.Pool, group, "thing", "c", "c2 was lost")
	require.NoError(t, err)
	res, err := f.el.SweepResult(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, res.Released)
	require.Len(t, res.GapsClosed, 2)
	require.Equal(t, map[string]float64{"filled": 1, "skipped": 1, "released": 1}, metrictest.SumByLabel(t, f.registry, "eventline_consumer_gap_duration_seconds", "outcome"))

	res, err = f.el.SweepResult(context.Background())
	require.NoError(t, err)
	require.Empty(t, res.GapsClosed)
	require.Equal(t, map[string]float64{"filled": 1, "skipped": 1, "released": 1}, metrictest.SumByLabel(t, f.registry, "eventline_consumer_gap_duration_seconds", "outcome"), "each gap is observed once")
}
