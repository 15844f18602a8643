package admin

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/versioning"
)

// collectTimeout bounds the database reads of one scrape.
const collectTimeout = 5 * time.Second

// statusCollector reports ReadOutboxStatus at scrape time.
type statusCollector struct {
	db     DBTX
	schema string

	backlog, oldest, stored, dead, retrying, up, ahead, heldBack, holderAge, holderPID *prometheus.Desc
}

// NewStatusCollector returns a Prometheus collector that reads the outbox
// status from the database on every scrape: eventline_outbox_backlog,
// eventline_outbox_oldest_pending_seconds, stored rows and
// eventline_outbox_position_ahead (1 when the shard needs
// RebasePositions) and eventline_outbox_held_back per shard; while rows
// are held back, eventline_outbox_horizon_holder_age_seconds and _pid (the
// oldest open transaction); dead letters waiting, rows waiting for a
// retry, and eventline_outbox_up (0 when the status could not be read).
// Each scrape is bounded by a 5-second timeout.
func NewStatusCollector(db DBTX, schema string) (prometheus.Collector, error) {
	if err := checkArgs("NewStatusCollector", db, schema); err != nil {
		return nil, err
	}
	shard := []string{"shard"}
	return &statusCollector{
		db: db, schema: schema,
		backlog:  prometheus.NewDesc("eventline_outbox_backlog", "Committed outbox rows not yet forwarded to Kafka.", shard, nil),
		oldest:   prometheus.NewDesc("eventline_outbox_oldest_pending_seconds", "Age of the oldest row not yet forwarded.", shard, nil),
		stored:   prometheus.NewDesc("eventline_outbox_stored_rows", "Rows in the shard's table, forwarded or not.", shard, nil),
		dead:     prometheus.NewDesc("eventline_outbox_dead_letters", "Dead letters not yet replayed.", nil, nil),
		retrying: prometheus.NewDesc("eventline_outbox_retrying", "Rows that failed to publish and wait for a retry.", nil, nil),
		up:       prometheus.NewDesc("eventline_outbox_up", "1 if the outbox status could be read.", nil, nil),
		ahead: prometheus.NewDesc("eventline_outbox_position_ahead",
			"1 when the shard's position or rows carry transaction ids this cluster has not handed out: run `eventline relay rebase-positions`.", shard, nil),
		heldBack: prometheus.NewDesc("eventline_outbox_held_back",
			"Committed rows the relays cannot read yet because an older transaction is open (the xmin horizon).", shard, nil),
		holderAge: prometheus.NewDesc("eventline_outbox_horizon_holder_age_seconds",
			"While rows are held back: how long the oldest open transaction (the one holding the xmin horizon) has been open.", nil, nil),
		holderPID: prometheus.NewDesc("eventline_outbox_horizon_holder_pid",
			"While rows are held back: the backend pid of the oldest open transaction (0 for a prepared one); see pg_stat_activity or eventline status.", nil, nil),
	}, nil
}

func (c *statusCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.backlog, c.oldest, c.stored, c.dead, c.retrying, c.up, c.ahead, c.heldBack, c.holderAge, c.holderPID} {
		ch <- d
	}
}

func (c *statusCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), collectTimeout)
	defer cancel()
	st, err := readOutboxStatus(ctx, c.db, c.schema)
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
	for _, s := range st.Shards {
		label := strconv.Itoa(s.Shard)
		ch <- prometheus.MustNewConstMetric(c.backlog, prometheus.GaugeValue, float64(s.Backlog), label)
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, s.OldestPending.Seconds(), label)
		ch <- prometheus.MustNewConstMetric(c.stored, prometheus.GaugeValue, float64(s.Stored), label)
		ahead := 0.0
		if s.PositionAhead {
			ahead = 1
		}
		ch <- prometheus.MustNewConstMetric(c.ahead, prometheus.GaugeValue, ahead, label)
		ch <- prometheus.MustNewConstMetric(c.heldBack, prometheus.GaugeValue, float64(s.HeldBack), label)
	}
	if h := st.HorizonHolder; h != nil {
		ch <- prometheus.MustNewConstMetric(c.holderAge, prometheus.GaugeValue, h.XactAge.Seconds())
		ch <- prometheus.MustNewConstMetric(c.holderPID, prometheus.GaugeValue, float64(h.PID))
	}
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, float64(st.DeadLetters))
	ch <- prometheus.MustNewConstMetric(c.retrying, prometheus.GaugeValue, float64(st.Retrying))
}

// NewGroupStatusCollector returns versioning.NewStatusCollector (the
// eventline_group_* gauges) for a schema that may have no consumer tables:
// a producer-only database whose consumers keep their tables elsewhere.
// At each scrape it looks for them first; when they are not there it
// reports no eventline_group_* series at all (not
// eventline_group_status_up 0, which would page for nothing). When the
// look-up itself fails (the database is unavailable) the status collector
// runs and reports eventline_group_status_up 0. A scrape never fails on
// it.
func NewGroupStatusCollector(db DBTX, schema string) (prometheus.Collector, error) {
	if err := checkArgs("NewGroupStatusCollector", db, schema); err != nil {
		return nil, err
	}
	groups, err := versioning.NewStatusCollector(db, schema)
	if err != nil {
		return nil, fmt.Errorf("admin.NewGroupStatusCollector: %w", err)
	}
	return &groupStatusCollector{Collector: groups, db: db, schema: schema}, nil
}

type groupStatusCollector struct {
	prometheus.Collector
	db     DBTX
	schema string
}

func (c *groupStatusCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), collectTimeout)
	defer cancel()
	// 002_consumer creates both; versioning.ReadGroupStatuses works from it on.
	var absent bool
	err := c.db.QueryRow(ctx, `SELECT to_regclass($1) IS NULL AND to_regclass($2) IS NULL`,
		sqlident.Qualify(c.schema, "aggregate_versions"), sqlident.Qualify(c.schema, "parked_events")).Scan(&absent)
	if err == nil && absent {
		return
	}
	c.Collector.Collect(ch)
}
