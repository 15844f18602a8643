package middleware

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics holds eventline's consumer-side Prometheus collectors. A nil
// *Metrics is valid and records nothing, so metrics stay optional.
// Counters of effects (applied, stale, parked, late, released, skipped)
// are incremented only after the transaction that caused them committed;
// refusals are counted when they happen.
//
// All series carry a "group" label (the consumer group); per-event series
// also carry "event_type". Event types come from the wire, so that label is
// bounded: types registered with [Metrics.RegisterEventTypes] (the
// consumer package registers every type it handles or ignores) keep their
// name, as do the first MaxUnregisteredEventTypes other types seen;
// every further type is counted under OtherEventType.
type Metrics struct {
	applied         *prometheus.CounterVec
	duplicates      *prometheus.CounterVec
	stale           *prometheus.CounterVec
	parkedTotal     *prometheus.CounterVec
	parked          *prometheus.GaugeVec
	released        *prometheus.CounterVec
	releaseFailures *prometheus.CounterVec
	gapsSkipped     *prometheus.CounterVec
	late            *prometheus.CounterVec
	lateHeld        *prometheus.GaugeVec
	lateApplied     *prometheus.CounterVec
	givenUp         *prometheus.CounterVec
	refused         *prometheus.CounterVec
	handlerSeconds  *prometheus.HistogramVec
	deadLettered    *prometheus.CounterVec
	failpath        failpathMetrics
	gaps            gapMetrics
	stages          *prometheus.HistogramVec // metrics_stage.go

	types typeLabels
}

// The event_type label's bound (see Metrics).
const (
	// MaxUnregisteredEventTypes is how many event types not registered
	// with RegisterEventTypes get a label of their own; later ones are
	// counted as OtherEventType, so hostile or buggy producers cannot
	// create unbounded series.
	MaxUnregisteredEventTypes = 50
	// OtherEventType is the event_type label of event types beyond the
	// bound.
	OtherEventType = "other"
)

// metricsNamespace prefixes every metric name: eventline_consumer_….
const metricsNamespace = "eventline"

// The reasons of eventline_consumer_events_refused_total: events the gate
// refuses as permanent errors (they are dead-lettered with the reason).
const (
	// refusedIDConflict: the event id is recorded for a different event.
	refusedIDConflict = "id_conflict"
	// refusedGapTooLarge: the event, declaring no predecessor, would
	// leave more than MaxGap versions missing (an inflated version).
	refusedGapTooLarge = "gap_too_large"
	// refusedInvalid: the event cannot be parked or held (Validate failed,
	// or its content cannot be stored).
	refusedInvalid = "invalid"
)

// NewMetrics creates the collectors and, when reg is not nil, registers
// them with it. *Metrics is itself a prometheus.Collector, so it can also
// be registered later.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: metricsNamespace, Subsystem: "consumer", Name: name, Help: help}, labels)
	}
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: metricsNamespace, Subsystem: "consumer", Name: name, Help: help}, []string{"group"})
	}
	m := &Metrics{
		applied:         counter("events_applied_total", "Events whose handler ran and committed on arrival.", "group", "event_type"),
		duplicates:      counter("events_duplicate_total", "Redelivered events recognised by the dedup record; the handler did not run.", "group", "event_type"),
		stale:           counter("events_stale_total", "Events discarded because the aggregate was already at or past their version, which was not skipped.", "group", "event_type"),
		parkedTotal:     counter("events_parked_total", "Events parked to wait for a missing earlier version.", "group", "event_type"),
		released:        counter("parked_released_total", "Parked events applied after their missing versions arrived or were skipped.", "group"),
		releaseFailures: counter("parked_release_failures_total", "Attempts to apply a parked event whose handler failed; the event stays parked and is retried after a backoff.", "group"),
		gapsSkipped:     counter("gaps_skipped_total", "Version gaps given up on: by the Apply policy (policy_apply), by the sweeper after the park timeout (park_timeout), or with a parked event given up (given_up).", "group", "reason"),
		late: counter("late_events_total", "Events that arrived after their version was given up on: held for the operator (action held) or applied at once with IsLate (action applied).",
			"group", "event_type", "action"),
		lateApplied:  counter("late_applied_total", "Late events applied on an operator's request (eventline held replay).", "group"),
		givenUp:      counter("parked_given_up_total", "Parked events given up after the release-attempt limit or a permanent failure: dead-lettered, their version recorded as skipped.", "group"),
		refused:      counter("events_refused_total", "Events the gate refused as permanent errors (dead-lettered): id_conflict, gap_too_large, invalid.", "group", "reason"),
		deadLettered: counter("events_dead_lettered_total", "Messages dead-lettered (held in held_events), by cause.", "group", "reason"),
		parked:       gauge("parked_events", "Events currently parked, as counted by the last sweeper pass."),
		lateHeld:     gauge("late_events", "Late events currently held for the operator (arrived late, passed while parked, or given up), as counted by the last sweeper pass."),
		handlerSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: metricsNamespace, Subsystem: "consumer", Name: "handler_duration_seconds",
			Help: "Time spent in the user's handler, per event.", Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}, []string{"group", "event_type"}),
		types: typeLabels{registered: map[string]bool{}, seen: map[string]bool{}},
	}
	m.failpath = newFailpathMetrics(counter)
	m.gaps = newGapMetrics()
	m.stages = newStageHistogram()
	if reg != nil {
		if err := reg.Register(m); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// RegisterEventTypes declares event types the consumer expects: they keep
// their own event_type label whatever arrives on the wire.
func (m *Metrics) RegisterEventTypes(types ...string) {
	if m == nil {
		return
	}
	m.types.mu.Lock()
	defer m.types.mu.Unlock()
	for _, t := range types {
		m.types.registered[t] = true
	}
}

// typeLabels bounds the event_type label (see Metrics).
type typeLabels struct {
	mu         sync.RWMutex
	registered map[string]bool
	seen       map[string]bool
}

// label returns the event_type label value for typ.
func (l *typeLabels) label(typ string) string {
	l.mu.RLock()
	known := l.registered[typ] || l.seen[typ]
	full := len(l.seen) >= MaxUnregisteredEventTypes
	l.mu.RUnlock()
	switch {
	case known:
		return typ
	case full || typ == OtherEventType:
		return OtherEventType
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.registered[typ] || l.seen[typ] {
		return typ
	}
	if len(l.seen) >= MaxUnregisteredEventTypes {
		return OtherEventType
	}
	l.seen[typ] = true
	return typ
}

func (m *Metrics) collectors() []prometheus.Collector {
	return append([]prometheus.Collector{m.applied, m.duplicates, m.stale, m.parkedTotal, m.parked, m.released,
		m.releaseFailures, m.gapsSkipped, m.late, m.lateHeld, m.lateApplied, m.givenUp, m.refused, m.handlerSeconds, m.deadLettered},
		append(append(m.failpath.collectors(), m.gaps.collectors()...), m.stages)...)
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
		m.applied.WithLabelValues(group, m.types.label(typ)).Inc()
	}
}

func (m *Metrics) incDuplicate(group, typ string) {
	if m != nil {
		m.duplicates.WithLabelValues(group, m.types.label(typ)).Inc()
	}
}

func (m *Metrics) incStale(group, typ string) {
	if m != nil {
		m.stale.WithLabelValues(group, m.types.label(typ)).Inc()
	}
}

func (m *Metrics) incParked(group, typ string) {
	if m != nil {
		m.parkedTotal.WithLabelValues(group, m.types.label(typ)).Inc()
	}
}

func (m *Metrics) incLate(group, typ, action string) {
	if m != nil {
		m.late.WithLabelValues(group, m.types.label(typ), action).Inc()
	}
}

func (m *Metrics) addLateApplied(group string, n int) {
	if m != nil && n > 0 {
		m.lateApplied.WithLabelValues(group).Add(float64(n))
	}
}

func (m *Metrics) addGivenUp(group string, n int) {
	if m != nil && n > 0 {
		m.givenUp.WithLabelValues(group).Add(float64(n))
		m.gapsSkipped.WithLabelValues(group, "given_up").Add(float64(n))
	}
}

func (m *Metrics) incRefused(group, reason string) {
	if m != nil {
		m.refused.WithLabelValues(group, reason).Inc()
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

func (m *Metrics) setParked(group string, parked, late int64) {
	if m != nil {
		m.parked.WithLabelValues(group).Set(float64(parked))
		m.lateHeld.WithLabelValues(group).Set(float64(late))
	}
}

func (m *Metrics) observeHandler(group, typ string, d time.Duration) {
	if m != nil {
		m.handlerSeconds.WithLabelValues(group, m.types.label(typ)).Observe(d.Seconds())
	}
}

// incDeadLettered counts a dead-lettered message; reason is its kind, such
// as "permanent" or "retries_exhausted".
func (m *Metrics) incDeadLettered(group, reason string) {
	if m != nil {
		m.deadLettered.WithLabelValues(group, reason).Inc()
	}
}
