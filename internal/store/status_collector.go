package store

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// statusCollector reports ReadGroupStatuses at scrape time.
type statusCollector struct {
	db      DBTX
	store   *Store
	timeout time.Duration

	up, parked, oldestParked, openGaps, oldestGap, skipped, late, dead *prometheus.Desc
}

// NewStatusCollector returns a Prometheus collector that reads every
// consumer group's gap and stall status (ReadGroupStatuses) from the
// store's tables on each scrape (`eventline relay` serves it; the admin
// package is to export it). Its series carry only the "group"
// label, whose values are the consumer groups recorded in the database
// (set by configuration, not by events on the wire):
//
//   - eventline_group_parked_events, eventline_group_oldest_parked_seconds
//   - eventline_group_open_gaps, eventline_group_oldest_open_gap_seconds
//   - eventline_group_skipped_gaps_24h
//   - eventline_group_late_events
//   - eventline_group_dead_letters
//
// and eventline_group_status_up (0 when the status could not be read).
// Unlike the consumer's own gauges they are right even when no consumer
// of the group runs. Each scrape costs one query per group, plus one for
// the groups, bounded by a 5-second timeout.
func (s *Store) NewStatusCollector(db DBTX) prometheus.Collector {
	group := []string{"group"}
	desc := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("eventline_group_"+name, help, group, nil)
	}
	return &statusCollector{
		db: db, store: s, timeout: 5 * time.Second,
		up:           prometheus.NewDesc("eventline_group_status_up", "1 if the consumer groups' status could be read from the database.", nil, nil),
		parked:       desc("parked_events", "Events parked waiting for a missing earlier version of their aggregate."),
		oldestParked: desc("oldest_parked_seconds", "Age of the group's oldest parked event; 0 when none."),
		openGaps:     desc("open_gaps", "Aggregates whose lowest parked event waits for versions that have not arrived."),
		oldestGap:    desc("oldest_open_gap_seconds", "Age of the oldest open gap (since the aggregate's oldest parked event parked); 0 when none."),
		skipped:      desc("skipped_gaps_24h", "Gaps recorded in skipped_versions in the last 24 hours (park timeout, gap policy, give-ups, operator releases)."),
		late:         desc("late_events", "Late events held for the operator, not yet replayed or discarded (eventline held list -kind late)."),
		dead:         desc("dead_letters", "Consumer dead letters not yet replayed or discarded (eventline held list -kind dead_letter)."),
	}
}

func (c *statusCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.up, c.parked, c.oldestParked, c.openGaps, c.oldestGap, c.skipped, c.late, c.dead} {
		ch <- d
	}
}

func (c *statusCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	groups, err := c.store.ReadGroupStatuses(ctx, c.db, ReadGroupStatusOptions{OpenGapsLimit: -1})
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
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
		gauge(c.dead, float64(g.DeadLetters), g.Group)
	}
}
