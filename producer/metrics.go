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
	counters    [numShardCounters]*prometheus.CounterVec
	flags       [numShardFlags]*prometheus.GaugeVec
	latency     prometheus.Histogram
	ownedShards prometheus.Gauge
	liveRelays  prometheus.Gauge
}

// shardCounter names a per-shard counter of RelayMetrics.
type shardCounter int

const (
	forwardedCounter shardCounter = iota
	retriesCounter
	deadLettersCounter
	stalledSecondsCounter
	restartsCounter
	leaseExpiredCounter
	fencesClearedCounter
	numShardCounters
)

// shardFlag names a per-shard 0/1 gauge of RelayMetrics.
type shardFlag int

const (
	stalledFlag shardFlag = iota
	positionAheadFlag
	numShardFlags
)

// metricText is a metric's name (under eventline_relay_) and help.
type metricText struct{ name, help string }

var shardCounterTexts = [numShardCounters]metricText{
	forwardedCounter:      {"forwarded_total", "Events acknowledged by Kafka and recorded as forwarded, per outbox shard."},
	retriesCounter:        {"retries_total", "Failed publishes that the shard waits on and retries, per outbox shard."},
	deadLettersCounter:    {"dead_letters_total", "Events moved to the dead-letter table, per outbox shard."},
	stalledSecondsCounter: {"xmin_stalled_seconds_total", "Time the shard spent stalled behind the xmin horizon."},
	restartsCounter:       {"shard_restarts_total", "Times a shard's relaying stopped without being asked to (set-up failed, forwarder ended) and was restarted."},
	leaseExpiredCounter:   {"lease_expired_total", "Times a shard was stopped because its lease could not be renewed in time (the database did not answer)."},
	fencesClearedCounter:  {"stale_transactions_ended_total", "Transactions of a vanished previous owner that still held the shard and were terminated on takeover."},
}

var shardFlagTexts = [numShardFlags]metricText{
	stalledFlag:       {"xmin_stalled", "1 while committed events of the shard wait behind an older open transaction (the xmin horizon)."},
	positionAheadFlag: {"position_ahead", "1 when the shard's position or rows carry transaction ids this cluster has not handed out (the outbox was restored or replicated from another cluster): nothing is relayed until `eventline relay rebase-positions` runs."},
}

// NewRelayMetrics creates the relay's collectors and registers them with
// reg (nowhere when nil, like promauto.With(nil)).
func NewRelayMetrics(reg prometheus.Registerer) (*RelayMetrics, error) {
	opts := func(t metricText) prometheus.Opts {
		return prometheus.Opts{Namespace: "eventline", Subsystem: "relay", Name: t.name, Help: t.help}
	}
	m := &RelayMetrics{
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "eventline", Subsystem: "relay", Name: "publish_latency_seconds",
			Help:    "Time from an event's occurred_at (its PublishTx, unless the caller set it) to Kafka's acknowledgement.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
		}),
		ownedShards: prometheus.NewGauge(prometheus.GaugeOpts(opts(metricText{"owned_shards", "Outbox shards this relay is relaying."}))),
		liveRelays:  prometheus.NewGauge(prometheus.GaugeOpts(opts(metricText{"live_relays", "Relays sharing the outbox, as this relay last counted them."}))),
	}
	collectors := []prometheus.Collector{m.latency, m.ownedShards, m.liveRelays}
	for i, t := range shardCounterTexts {
		m.counters[i] = prometheus.NewCounterVec(prometheus.CounterOpts(opts(t)), []string{"shard"})
		collectors = append(collectors, m.counters[i])
	}
	for i, t := range shardFlagTexts {
		m.flags[i] = prometheus.NewGaugeVec(prometheus.GaugeOpts(opts(t)), []string{"shard"})
		collectors = append(collectors, m.flags[i])
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range collectors {
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

func (m *RelayMetrics) add(c shardCounter, shard int, v float64) {
	if m != nil {
		m.counters[c].WithLabelValues(strconv.Itoa(shard)).Add(v)
	}
}

// set sets the shard's gauge f to 1 when on, else 0.
func (m *RelayMetrics) set(f shardFlag, shard int, on bool) {
	if m == nil {
		return
	}
	v := 0.0
	if on {
		v = 1
	}
	m.flags[f].WithLabelValues(strconv.Itoa(shard)).Set(v)
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
