package middleware

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline/internal/store"
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
	counters          [numCounters]*prometheus.CounterVec
	parked            *prometheus.GaugeVec
	lateHeld          *prometheus.GaugeVec
	waitingOnDatabase *prometheus.GaugeVec
	handlerSeconds    *prometheus.HistogramVec
	gapSeconds        *prometheus.HistogramVec
	stages            *prometheus.HistogramVec

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

// counter names a counter of Metrics.
type counter int

const (
	// Labels group, event_type (see Metrics.eventType).
	appliedCounter counter = iota
	duplicateCounter
	staleCounter
	parkedCounter
	// Labels group, event_type, action.
	lateCounter
	// Label group.
	releasedCounter
	releaseFailuresCounter
	lateAppliedCounter
	givenUpCounter
	infraWaitsCounter
	deadLetterWriteFailuresCounter
	unsafeCompositionsCounter
	hookPanicsCounter
	// Labels group and the reason (result for replays).
	gapsSkippedCounter
	refusedCounter
	deadLetteredCounter
	retriesCounter
	replaysCounter
	numCounters
)

// metricText is a metric's name (under eventline_consumer_), help and
// labels.
type metricText struct {
	name, help string
	labels     []string
}

var (
	byGroup = []string{"group"}
	byType  = []string{"group", "event_type"}
)

var counterTexts = [numCounters]metricText{
	appliedCounter:   {"events_applied_total", "Events whose handler ran and committed on arrival.", byType},
	duplicateCounter: {"events_duplicate_total", "Redelivered events recognised by the dedup record; the handler did not run.", byType},
	staleCounter:     {"events_stale_total", "Events discarded because the aggregate was already at or past their version, which was not skipped.", byType},
	parkedCounter:    {"events_parked_total", "Events parked to wait for a missing earlier version.", byType},
	lateCounter: {"late_events_total", "Events that arrived after their version was given up on: held for the operator (action held) or applied at once with IsLate (action applied).",
		[]string{"group", "event_type", "action"}},
	releasedCounter:        {"parked_released_total", "Parked events applied after their missing versions arrived or were skipped.", byGroup},
	releaseFailuresCounter: {"parked_release_failures_total", "Attempts to apply a parked event whose handler failed; the event stays parked and is retried after a backoff.", byGroup},
	lateAppliedCounter:     {"late_applied_total", "Late events applied on an operator's request (eventline held replay).", byGroup},
	givenUpCounter:         {"parked_given_up_total", "Parked events given up after the release-attempt limit or a permanent failure: dead-lettered, their version recorded as skipped.", byGroup},
	infraWaitsCounter: {"infra_waits_total",
		"Waits because the database was unavailable (refused, reset, restarting, not answering, commit outcome unknown). They never spend the retry budget or dead-letter an event.", byGroup},
	deadLetterWriteFailuresCounter: {"dead_letter_write_failures_total",
		"Failed writes of a dead letter to held_events; the message stays unacknowledged and the write is retried.", byGroup},
	unsafeCompositionsCounter: {"unsafe_compositions_total",
		"Events refused because the middleware chain was composed unsafely (a poison queue or retry inside the eventline transaction); nothing was committed.", byGroup},
	hookPanicsCounter: {"after_commit_panics_total",
		"AfterCommit hooks that panicked after their transaction committed: recovered and logged with the event; the other hooks ran, the event stays applied.", byGroup},
	gapsSkippedCounter: {"gaps_skipped_total", "Version gaps given up on: by the Apply policy (policy_apply), by the sweeper after the park timeout (park_timeout), or with a parked event given up (given_up).",
		[]string{"group", "reason"}},
	refusedCounter:      {"events_refused_total", "Events the gate refused as permanent errors (dead-lettered): id_conflict, gap_too_large, invalid.", []string{"group", "reason"}},
	deadLetteredCounter: {"events_dead_lettered_total", "Messages dead-lettered (held in held_events), by cause.", []string{"group", "reason"}},
	retriesCounter: {"retries_total", "Attempts retried after a failure: reason handler (spends the retry budget) or conflict (a serialization failure or deadlock; does not).",
		[]string{"group", "reason"}},
	replaysCounter: {"dead_letters_replayed_total", "Dead letters replayed on request: result replayed or failed.", []string{"group", "result"}},
}

// gapDurationBuckets are the buckets (seconds) of
// eventline_consumer_gap_duration_seconds: from a reordering that heals
// within milliseconds to gaps an operator releases after a day.
var gapDurationBuckets = []float64{.01, .05, .25, 1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 21600, 86400}

// stageBuckets span a fast local hop (1ms) to a parked event released
// after a long wait (hours).
var stageBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600}

// NewMetrics creates the collectors and, when reg is not nil, registers
// them with it. *Metrics is itself a prometheus.Collector, so it can also
// be registered later.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	opts := func(name, help string) prometheus.Opts {
		return prometheus.Opts{Namespace: "eventline", Subsystem: "consumer", Name: name, Help: help}
	}
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts(opts(name, help)), byGroup)
	}
	histogram := func(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "eventline", Subsystem: "consumer", Name: name, Help: help, Buckets: buckets}, labels)
	}
	m := &Metrics{
		parked:            gauge("parked_events", "Events currently parked, as counted by the last sweeper pass."),
		lateHeld:          gauge("late_events", "Late events currently held for the operator (arrived late, passed while parked, or given up), as counted by the last sweeper pass."),
		waitingOnDatabase: gauge("waiting_on_database", "Events currently waiting for the database to answer again; above 0 during an outage."),
		handlerSeconds: histogram("handler_duration_seconds", "Time spent in the user's handler, per event.",
			prometheus.ExponentialBuckets(0.0005, 2, 14), byType...),
		gapSeconds: histogram("gap_duration_seconds",
			"How long version gaps in front of parked events stayed open, by how they closed: filled (the missing version arrived), skipped (the sweeper gave up after the park timeout) or released (an operator gave up, eventline parked release).",
			gapDurationBuckets, "group", "outcome"),
		stages: histogram("stage_seconds",
			"Latency of an event's stages: relayed_to_applied (Kafka record timestamp to the commit that applied it on arrival), "+
				"occurred_to_applied (its occurred_at, the PublishTx time unless set by the publisher, to that commit), "+
				"parked_to_released (parked to the commit that applied it).",
			stageBuckets, "group", "stage"),
		types: typeLabels{registered: map[string]bool{}, seen: map[string]bool{}},
	}
	for i, t := range counterTexts {
		m.counters[i] = prometheus.NewCounterVec(prometheus.CounterOpts(opts(t.name, t.help)), t.labels)
	}
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
	cs := []prometheus.Collector{m.parked, m.lateHeld, m.waitingOnDatabase, m.handlerSeconds, m.gapSeconds, m.stages}
	for _, c := range m.counters {
		cs = append(cs, c)
	}
	return cs
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

// eventType is the event_type label of typ (typ itself on a nil *Metrics,
// which counts nothing).
func (m *Metrics) eventType(typ string) string {
	if m == nil {
		return typ
	}
	return m.types.label(typ)
}

// add adds n, when positive, to the series of counter c with labels, in
// the order of its counterTexts entry (the group first; an event_type
// through eventType).
func (m *Metrics) add(c counter, n int, labels ...string) {
	if m != nil && n > 0 {
		m.counters[c].WithLabelValues(labels...).Add(float64(n))
	}
}

// addGivenUp counts parked events given up, and their versions as skipped
// gaps.
func (m *Metrics) addGivenUp(group string, n int) {
	m.add(givenUpCounter, n, group)
	m.add(gapsSkippedCounter, n, group, "given_up")
}

func (m *Metrics) setParked(group string, parked, late int64) {
	if m != nil {
		m.parked.WithLabelValues(group).Set(float64(parked))
		m.lateHeld.WithLabelValues(group).Set(float64(late))
	}
}

func (m *Metrics) addWaitingOnDatabase(group string, d float64) {
	if m != nil {
		m.waitingOnDatabase.WithLabelValues(group).Add(d)
	}
}

func (m *Metrics) observeHandler(group, typ string, d time.Duration) {
	if m != nil {
		m.handlerSeconds.WithLabelValues(group, m.types.label(typ)).Observe(d.Seconds())
	}
}

// observeGapsClosed records closed gaps; call it after their transaction
// committed.
func (m *Metrics) observeGapsClosed(group string, gaps []store.ClosedGap) {
	if m == nil {
		return
	}
	for _, g := range gaps {
		m.gapSeconds.WithLabelValues(group, string(g.Outcome)).Observe(g.Open.Seconds())
	}
}

func (m *Metrics) observeStage(group, stage string, d time.Duration) {
	if m != nil {
		m.stages.WithLabelValues(group, stage).Observe(max(d, 0).Seconds())
	}
}
