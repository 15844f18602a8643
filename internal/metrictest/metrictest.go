// Package metrictest reads Prometheus metrics back in tests and examples.
package metrictest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Sum gathers g and returns the sum of every series of the metric family
// name, counters and gauges alike; 0 when the family has no series yet.
func Sum(t testing.TB, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	sum, err := Value(g, name, nil)
	if err != nil {
		t.Fatalf("gather metrics: %v", err)
	}
	return sum
}

// Value gathers g and returns the sum of the series of the counter or
// gauge name whose labels include the given ones (a nil map matches all).
func Value(g prometheus.Gatherer, name string, labels map[string]string) (float64, error) {
	families, err := g.Gather()
	if err != nil {
		return 0, err
	}
	var sum float64
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue series
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum, nil
}

// SumByLabel gathers g and returns, per value of label, the sum over the
// series of the metric family name of their values (counters, gauges) or
// sample counts (histograms).
func SumByLabel(t testing.TB, g prometheus.Gatherer, name, label string) map[string]float64 {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatalf("gather metrics: %v", err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label {
					out[l.GetValue()] += m.GetCounter().GetValue() + m.GetGauge().GetValue() + float64(m.GetHistogram().GetSampleCount())
				}
			}
		}
	}
	return out
}
