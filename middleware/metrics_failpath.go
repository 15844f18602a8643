package middleware

import "github.com/prometheus/client_golang/prometheus"

// failpathMetrics are the collectors of the failure path: retries, waits
// for the database, dead-letter writes and replays, unsafe compositions.
type failpathMetrics struct {
	retries            *prometheus.CounterVec
	infraWaits         *prometheus.CounterVec
	waitingOnDatabase  *prometheus.GaugeVec
	deadLetterWrites   *prometheus.CounterVec
	deadLettersReplay  *prometheus.CounterVec
	unsafeCompositions *prometheus.CounterVec
	hookPanics         *prometheus.CounterVec
}

func newFailpathMetrics(counter func(name, help string, labels ...string) *prometheus.CounterVec) failpathMetrics {
	return failpathMetrics{
		retries: counter("retries_total", "Attempts retried after a failure: reason handler (spends the retry budget) or conflict (a serialization failure or deadlock; does not).", "group", "reason"),
		infraWaits: counter("infra_waits_total",
			"Waits because the database was unavailable (refused, reset, restarting, not answering, commit outcome unknown). They never spend the retry budget or dead-letter an event.", "group"),
		waitingOnDatabase: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: metricsNamespace, Subsystem: "consumer", Name: "waiting_on_database",
			Help: "Events currently waiting for the database to answer again; above 0 during an outage."}, []string{"group"}),
		deadLetterWrites: counter("dead_letter_write_failures_total",
			"Failed writes of a dead letter to held_events; the message stays unacknowledged and the write is retried.", "group"),
		deadLettersReplay: counter("dead_letters_replayed_total", "Dead letters replayed on request: result replayed or failed.", "group", "result"),
		unsafeCompositions: counter("unsafe_compositions_total",
			"Events refused because the middleware chain was composed unsafely (a poison queue or retry inside the eventline transaction); nothing was committed.", "group"),
		hookPanics: counter("after_commit_panics_total",
			"AfterCommit hooks that panicked after their transaction committed: recovered and logged with the event; the other hooks ran, the event stays applied.", "group"),
	}
}

func (f failpathMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{f.retries, f.infraWaits, f.waitingOnDatabase, f.deadLetterWrites,
		f.deadLettersReplay, f.unsafeCompositions, f.hookPanics}
}

func (m *Metrics) incRetry(group, reason string) {
	if m != nil {
		m.failpath.retries.WithLabelValues(group, reason).Inc()
	}
}

func (m *Metrics) incInfraWait(group string) {
	if m != nil {
		m.failpath.infraWaits.WithLabelValues(group).Inc()
	}
}

func (m *Metrics) addWaitingOnDatabase(group string, d float64) {
	if m != nil {
		m.failpath.waitingOnDatabase.WithLabelValues(group).Add(d)
	}
}

func (m *Metrics) incDeadLetterWriteFailure(group string) {
	if m != nil {
		m.failpath.deadLetterWrites.WithLabelValues(group).Inc()
	}
}

func (m *Metrics) incReplay(group, result string) {
	if m != nil {
		m.failpath.deadLettersReplay.WithLabelValues(group, result).Inc()
	}
}

func (m *Metrics) incUnsafeComposition(group string) {
	if m != nil {
		m.failpath.unsafeCompositions.WithLabelValues(group).Inc()
	}
}

func (m *Metrics) incHookPanic(group string) {
	if m != nil {
		m.failpath.hookPanics.WithLabelValues(group).Inc()
	}
}
