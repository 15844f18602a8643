package producer

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// RelayMetrics are the relay's Prometheus collectors. A nil *RelayMetrics
// records nothing. Figures that need the database (backlog, oldest pending
// age, dead letters waiting) come from admin.NewStatusCollector instead, so they
// are right even when no relay runs.
type RelayMetrics struct {
	forwarded      *prometheus.CounterVec
	latency        prometheus.Histogram
	retries        *prometheus.CounterVec
	deadLetters    *prometheus.CounterVec
	stalled        *prometheus.GaugeVec
	stalledSeconds *prometheus.CounterVec
	ownedShards    prometheus.Gauge
	liveRelays     prometheus.Gauge
	restarts       *prometheus.CounterVec
	leaseExpired   *prometheus.CounterVec
	fencesCleared  *prometheus.CounterVec
	positionAhead  *prometheus.GaugeVec
}

// NewRelayMetrics creates the relay's collectors and registers them with
// reg (nowhere when nil, like promauto.With(nil)).
func NewRelayMetrics(reg prometheus.Registerer) (*RelayMetrics, error) {
	shard := []string{"shard"}
	m := &RelayMetrics{
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "forwarded_total",
			Help: "Events acknowledged by Kafka and recorded as forwarded, per outbox shard.",
		}, shard),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "publish_latency_seconds",
			Help:    "Time from an event's occurred_at (its PublishTx, unless the caller set it) to Kafka's acknowledgement.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
		}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "retries_total",
			Help: "Failed publishes that the shard waits on and retries, per outbox shard.",
		}, shard),
		deadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "dead_letters_total",
			Help: "Events moved to the dead-letter table, per outbox shard.",
		}, shard),
		stalled: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "xmin_stalled",
			Help: "1 while committed events of the shard wait behind an older open transaction (the xmin horizon).",
		}, shard),
		stalledSeconds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "xmin_stalled_seconds_total",
			Help: "Time the shard spent stalled behind the xmin horizon.",
		}, shard),
		ownedShards: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "owned_shards",
			Help: "Outbox shards this relay is relaying.",
		}),
		liveRelays: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "live_relays",
			Help: "Relays sharing the outbox, as this relay last counted them.",
		}),
		restarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "shard_restarts_total",
			Help: "Times a shard's relaying stopped without being asked to (set-up failed, forwarder ended) and was restarted.",
		}, shard),
		leaseExpired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "lease_expired_total",
			Help: "Times a shard was stopped because its lease could not be renewed in time (the database did not answer).",
		}, shard),
		fencesCleared: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "stale_transactions_ended_total",
			Help: "Transactions of a vanished previous owner that still held the shard and were terminated on takeover.",
		}, shard),
		positionAhead: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "position_ahead",
			Help: "1 when the shard's position or rows carry transaction ids this cluster has not handed out (the outbox was restored or replicated from another cluster): nothing is relayed until `eventline relay rebase-positions` runs.",
		}, shard),
	}
	for _, c := range []prometheus.Collector{m.forwarded, m.latency, m.retries, m.deadLetters, m.stalled, m.stalledSeconds, m.ownedShards, m.liveRelays,
		m.restarts, m.leaseExpired, m.fencesCleared, m.positionAhead} {
		if reg == nil {
			break
		}
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *RelayMetrics) observePublish(it *item, err error) {
	if m == nil || err != nil || it.event.OccurredAt.IsZero() {
		return
	}
	m.latency.Observe(time.Since(it.event.OccurredAt).Seconds())
}

func (m *RelayMetrics) addForwarded(shard, n int) {
	if m != nil && n > 0 {
		m.forwarded.WithLabelValues(strconv.Itoa(shard)).Add(float64(n))
	}
}

func (m *RelayMetrics) addRetry(shard int) {
	if m != nil {
		m.retries.WithLabelValues(strconv.Itoa(shard)).Inc()
	}
}

func (m *RelayMetrics) addDeadLetter(shard int) {
	if m != nil {
		m.deadLetters.WithLabelValues(strconv.Itoa(shard)).Inc()
	}
}

func (m *RelayMetrics) setStalled(shard int, stalled bool) {
	if m == nil {
		return
	}
	v := 0.0
	if stalled {
		v = 1
	}
	m.stalled.WithLabelValues(strconv.Itoa(shard)).Set(v)
}

func (m *RelayMetrics) addStalled(shard int, d time.Duration) {
	if m != nil {
		m.stalledSeconds.WithLabelValues(strconv.Itoa(shard)).Add(d.Seconds())
	}
}

func (m *RelayMetrics) setOwnedShards(n int) {
	if m != nil {
		m.ownedShards.Set(float64(n))
	}
}

func (m *RelayMetrics) setLiveRelays(n int) {
	if m != nil {
		m.liveRelays.Set(float64(n))
	}
}

func (m *RelayMetrics) addShardRestart(shard int) {
	if m != nil {
		m.restarts.WithLabelValues(strconv.Itoa(shard)).Inc()
	}
}

func (m *RelayMetrics) addLeaseExpired(shard int) {
	if m != nil {
		m.leaseExpired.WithLabelValues(strconv.Itoa(shard)).Inc()
	}
}

func (m *RelayMetrics) addFenceCleared(shard int) {
	if m != nil {
		m.fencesCleared.WithLabelValues(strconv.Itoa(shard)).Inc()
	}
}

func (m *RelayMetrics) setPositionAhead(shard int, ahead bool) {
	if m == nil {
		return
	}
	v := 0.0
	if ahead {
		v = 1
	}
	m.positionAhead.WithLabelValues(strconv.Itoa(shard)).Set(v)
}
