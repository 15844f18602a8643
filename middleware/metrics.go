package middleware

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics holds eventline's consumer-side Prometheus collectors. A nil
// *Metrics is valid and records nothing, so metrics stay optional.
// Counters of effects (applied, stale, parked, released, skipped) are
// incremented only after the transaction that caused them committed.
//
// All series carry a "group" label (the consumer group); per-event series
// also carry "event_type".
type Metrics struct {
	applied         *prometheus.CounterVec
	duplicates      *prometheus.CounterVec
	stale           *prometheus.CounterVec
	parkedTotal     *prometheus.CounterVec
	parked          *prometheus.GaugeVec
	released        *prometheus.CounterVec
	releaseFailures *prometheus.CounterVec
	gapsSkipped     *prometheus.CounterVec
	handlerSeconds  *prometheus.HistogramVec
	deadLettered    *prometheus.CounterVec
	failpath        failpathMetrics
}

// MetricsNamespace prefixes every metric name: eventline_consumer_….
const MetricsNamespace = "eventline"

// NewMetrics creates the collectors and, when reg is not nil, registers
// them with it. *Metrics is itself a prometheus.Collector, so it can also
// be registered later.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: MetricsNamespace, Subsystem: "consumer", Name: name, Help: help}, labels)
	}
	m := &Metrics{
		applied:         counter("events_applied_total", "Events whose handler ran and committed on arrival.", "group", "event_type"),
		duplicates:      counter("events_duplicate_total", "Redelivered events recognised by the dedup record; the handler did not run.", "group", "event_type"),
		stale:           counter("events_stale_total", "Events discarded because the aggregate was already at or past their version.", "group", "event_type"),
		parkedTotal:     counter("events_parked_total", "Events parked to wait for a missing earlier version.", "group", "event_type"),
		released:        counter("parked_released_total", "Parked events applied after their missing versions arrived or were skipped.", "group"),
		releaseFailures: counter("parked_release_failures_total", "Attempts to apply a parked event whose handler failed; the event stays parked.", "group"),
		gapsSkipped:     counter("gaps_skipped_total", "Version gaps given up on: by the Apply policy, or by the sweeper after the park timeout.", "group", "reason"),
		deadLettered:    counter("events_dead_lettered_total", "Messages dead-lettered (written to consumer_dead_letters), by kind.", "group", "reason"),
		parked: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: MetricsNamespace, Subsystem: "consumer", Name: "parked_events",
			Help: "Events currently parked, as counted by the last sweeper pass."}, []string{"group"}),
		handlerSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: MetricsNamespace, Subsystem: "consumer", Name: "handler_duration_seconds",
			Help: "Time spent in the user's handler, per event.", Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}, []string{"group", "event_type"}),
	}
	m.failpath = newFailpathMetrics(counter)
	if reg != nil {
		if err := reg.Register(m); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) collectors() []prometheus.Collector {
	return append([]prometheus.Collector{m.applied, m.duplicates, m.stale, m.parkedTotal, m.parked, m.released,
		m.releaseFailures, m.gapsSkipped, m.handlerSeconds, m.deadLettered}, m.failpath.collectors()...)
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
}

func (m *Metrics) incApplied(group, typ string) {
	if m != nil {
		m.applied.WithLabelValues(group, typ).Inc()
	}
}

func (m *Metrics) incDuplicate(group, typ string) {
	if m != nil {
		m.duplicates.WithLabelValues(group, typ).Inc()
	}
}

func (m *Metrics) incStale(group, typ string) {
	if m != nil {
		m.stale.WithLabelValues(group, typ).Inc()
	}
}

func (m *Metrics) incParked(group, typ string) {
	if m != nil {
		m.parkedTotal.WithLabelValues(group, typ).Inc()
	}
}

func (m *Metrics) addReleased(group string, n int) {
	if m != nil && n > 0 {
		m.released.WithLabelValues(group).Add(float64(n))
	}
}

func (m *Metrics) addReleaseFailures(group string, n int) {
	if m != nil && n > 0 {
		m.releaseFailures.WithLabelValues(group).Add(float64(n))
	}
}

func (m *Metrics) addGapsSkipped(group, reason string, n int) {
	if m != nil && n > 0 {
		m.gapsSkipped.WithLabelValues(group, reason).Add(float64(n))
	}
}

func (m *Metrics) setParked(group string, n int64) {
	if m != nil {
		m.parked.WithLabelValues(group).Set(float64(n))
	}
}

func (m *Metrics) observeHandler(group, typ string, d time.Duration) {
	if m != nil {
		m.handlerSeconds.WithLabelValues(group, typ).Observe(d.Seconds())
	}
}

// DeadLettered counts a dead-lettered message; reason is its kind, such as
// "permanent" or "retries_exhausted". [DeadLetter] calls it; call it from
// your own dead-letter middleware.
func (m *Metrics) DeadLettered(group, reason string) {
	if m != nil {
		m.deadLettered.WithLabelValues(group, reason).Inc()
	}
}
