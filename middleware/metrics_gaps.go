package middleware

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline/internal/store"
)

// gapDurationBuckets are the buckets (seconds) of
// eventline_consumer_gap_duration_seconds: from a reordering that heals
// within milliseconds to gaps an operator releases after a day.
var gapDurationBuckets = []float64{.01, .05, .25, 1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 21600, 86400}

// gapMetrics are the collectors of closed version gaps.
type gapMetrics struct {
	duration *prometheus.HistogramVec
}

func newGapMetrics() gapMetrics {
	return gapMetrics{
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: metricsNamespace, Subsystem: "consumer", Name: "gap_duration_seconds",
			Help:    "How long version gaps in front of parked events stayed open, by how they closed: filled (the missing version arrived), skipped (the sweeper gave up after the park timeout) or released (an operator gave up, eventline parked release).",
			Buckets: gapDurationBuckets}, []string{"group", "outcome"}),
	}
}

func (g gapMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{g.duration}
}

// observeGapsClosed records closed gaps; call it after their transaction
// committed.
func (m *Metrics) observeGapsClosed(group string, gaps []store.ClosedGap) {
	if m == nil {
		return
	}
	for _, g := range gaps {
		m.gaps.duration.WithLabelValues(group, string(g.Outcome)).Observe(g.Open.Seconds())
	}
}
