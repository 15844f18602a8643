package middleware

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// stageBuckets span a fast local hop (1ms) to a parked event released
// after a long wait (hours).
var stageBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600}

// newStageHistogram is eventline_consumer_stage_seconds{group,stage}.
func newStageHistogram() *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: metricsNamespace, Subsystem: "consumer", Name: "stage_seconds",
		Help: "Latency of an event's stages: relayed_to_applied (Kafka record timestamp to the commit that applied it on arrival), " +
			"occurred_to_applied (its occurred_at, the PublishTx time unless set by the publisher, to that commit), " +
			"parked_to_released (parked to the commit that applied it).",
		Buckets: stageBuckets}, []string{"group", "stage"})
}

func (m *Metrics) observeStage(group, stage string, d time.Duration) {
	if m != nil {
		m.stages.WithLabelValues(group, stage).Observe(max(d, 0).Seconds())
	}
}
