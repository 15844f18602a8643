package admin

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
)

// collectTimeout bounds the database reads of one scrape.
const collectTimeout = 5 * time.Second

// statusCollector reports ReadOutboxStatus and the consumer groups'
// status (readGroups) at scrape time.
type statusCollector struct {
	db     DBTX
	schema string
	store  *store.Store

	backlog, oldest, stored, dead, retrying, up, ahead, heldBack, holderAge, holderPID *prometheus.Desc
	groupsUp, parked, oldestParked, openGaps, oldestGap, skipped, late, deadLetters    *prometheus.Desc
}

// NewStatusCollector returns a Prometheus collector that reads the
// status of the outbox and of every consumer group from schema on every
// scrape, each part bounded by a 5-second timeout. `eventline relay
// -metrics-addr` serves it.
//
// The outbox: eventline_outbox_backlog,
// eventline_outbox_oldest_pending_seconds, stored rows and
// eventline_outbox_position_ahead (1 when the shard needs
// RebasePositions) and eventline_outbox_held_back per shard; while rows
// are held back, eventline_outbox_horizon_holder_age_seconds and _pid (the
// oldest open transaction); dead letters waiting, rows waiting for a
// retry, and eventline_outbox_up (0 when the status could not be read). A
// schema without an outbox (a consumer-only database) reports no
// eventline_outbox_* series at all.
//
// The consumer groups, with only the "group" label, whose values are the
// groups recorded in the database (set by configuration, not by events on
// the wire): eventline_group_parked_events,
// eventline_group_oldest_parked_seconds, eventline_group_open_gaps,
// eventline_group_oldest_open_gap_seconds,
// eventline_group_skipped_gaps_24h, eventline_group_late_events,
// eventline_group_dead_letters, and eventline_group_status_up (0 when
// their status could not be read). Unlike a consumer's own gauges they are
// right even when no consumer of the group runs; each scrape costs one
// query per group. A schema without consumer tables (a producer-only
// database whose consumers keep their tables elsewhere) reports no
// eventline_group_* series at all, not eventline_group_status_up 0, which
// would page for nothing; when the look-up for them fails (the database
// is unavailable), eventline_group_status_up is 0. A scrape never fails
// on it.
func NewStatusCollector(db DBTX, schema string) (prometheus.Collector, error) {
	if err := checkArgs("NewStatusCollector", db, schema); err != nil {
		return nil, err
	}
	st, err := store.New(schema)
	if err != nil {
		return nil, fmt.Errorf("admin.NewStatusCollector: %w", err)
	}
	shard, group := []string{"shard"}, []string{"group"}
	desc := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("eventline_group_"+name, help, group, nil)
	}
	return &statusCollector{
		db: db, schema: schema, store: st,
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
		groupsUp:     prometheus.NewDesc("eventline_group_status_up", "1 if the consumer groups' status could be read from the database.", nil, nil),
		parked:       desc("parked_events", "Events parked waiting for a missing earlier version of their aggregate."),
		oldestParked: desc("oldest_parked_seconds", "Age of the group's oldest parked event; 0 when none."),
		openGaps:     desc("open_gaps", "Aggregates whose lowest parked event waits for versions that have not arrived."),
		oldestGap:    desc("oldest_open_gap_seconds", "Age of the oldest open gap (since the aggregate's oldest parked event parked); 0 when none."),
		skipped:      desc("skipped_gaps_24h", "Gaps recorded in skipped_versions in the last 24 hours (park timeout, gap policy, give-ups, operator releases)."),
		late:         desc("late_events", "Late events held for the operator, not yet replayed or discarded (eventline held list -kind late)."),
		deadLetters:  desc("dead_letters", "Consumer dead letters not yet replayed or discarded (eventline held list -kind dead_letter)."),
	}, nil
}

func (c *statusCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.backlog, c.oldest, c.stored, c.dead, c.retrying, c.up, c.ahead, c.heldBack, c.holderAge, c.holderPID,
		c.groupsUp, c.parked, c.oldestParked, c.openGaps, c.oldestGap, c.skipped, c.late, c.deadLetters} {
		ch <- d
	}
}

func (c *statusCollector) Collect(ch chan<- prometheus.Metric) {
	c.collectOutbox(ch)
	c.collectGroups(ch)
}

func (c *statusCollector) collectOutbox(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), collectTimeout)
	defer cancel()
	st, err := ReadOutboxStatus(ctx, c.db, c.schema)
	if errors.Is(err, outbox.ErrNotMigrated) {
		return // a consumer-only database: no outbox to report on
	}
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

// collectGroups reports the consumer groups on a schema that may have no
// consumer tables: it looks for them first.
func (c *statusCollector) collectGroups(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), collectTimeout)
	defer cancel()
	// 002_consumer creates both; readGroups works from it on.
	var absent bool
	err := c.db.QueryRow(ctx, `SELECT to_regclass($1) IS NULL AND to_regclass($2) IS NULL`,
		sqlident.Qualify(c.schema, "aggregate_versions"), sqlident.Qualify(c.schema, "parked_events")).Scan(&absent)
	if err == nil && absent {
		return
	}
	groups, err := readGroups(ctx, c.db, c.schema, c.store, -1, false)
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.groupsUp, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.groupsUp, prometheus.GaugeValue, 1)
	gauge := func(d *prometheus.Desc, v float64, group string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, group)
	}
	for _, g := range groups {
		gauge(c.parked, float64(g.Parked), g.Group)
		gauge(c.oldestParked, g.OldestParked.Seconds(), g.Group)
		gauge(c.openGaps, float64(g.OpenGapCount), g.Group)
		gauge(c.oldestGap, g.OldestGap.Seconds(), g.Group)
		gauge(c.skipped, float64(g.SkippedGapsRecent), g.Group)
		gauge(c.late, float64(g.LateHeld), g.Group)
		gauge(c.deadLetters, float64(g.DeadLetters), g.Group)
	}
}
