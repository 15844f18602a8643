package middleware_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/consumertest"
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

	families, err := f.registry.Gather()
	require.NoError(t, err)
	labels := map[string]float64{}
	for _, fam := range families {
		if fam.GetName() != "eventline_consumer_events_applied_total" {
			continue
		}
		for _, m := range fam.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "event_type" {
					labels[l.GetValue()] += m.GetCounter().GetValue()
				}
			}
		}
	}
	require.Len(t, labels, middleware.MaxUnregisteredEventTypes+2, "the first unregistered types, thing.changed and other")
	require.Equal(t, 1.0, labels["thing.changed"], "a registered type keeps its label")
	require.Equal(t, float64(n-middleware.MaxUnregisteredEventTypes), labels[middleware.OtherEventType])
	require.Equal(t, float64(n+1), f.metric(t, "eventline_consumer_events_applied_total"), "every event is still counted")
}
