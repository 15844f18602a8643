package producer

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
)

// ShardStatus describes one outbox shard.
type ShardStatus struct {
	Shard int
	// Backlog is the number of committed rows the relays have not
	// forwarded yet.
	Backlog int64
	// OldestPending is the age of the oldest of them; zero when none.
	OldestPending time.Duration
	// Stored is the number of rows in the table, forwarded or not.
	Stored int64
	// PositionAhead is set when the shard's position or rows carry
	// transaction ids this cluster has not handed out: the outbox was moved
	// from another cluster and nothing is relayed until RebasePositions
	// (`eventline relay rebase-positions`) runs.
	PositionAhead bool
}

// OutboxStatus is a snapshot of the outbox read from the database.
type OutboxStatus struct {
	Shards []ShardStatus
	// DeadLetters counts dead letters not yet replayed.
	DeadLetters int64
	// Retrying counts rows that failed to publish and wait for a retry.
	Retrying int64
}

// Backlog sums the shards' backlogs.
func (s OutboxStatus) Backlog() int64 {
	var n int64
	for _, sh := range s.Shards {
		n += sh.Backlog
	}
	return n
}

// OldestPending is the oldest pending age over all shards.
func (s OutboxStatus) OldestPending() time.Duration {
	var d time.Duration
	for _, sh := range s.Shards {
		d = max(d, sh.OldestPending)
	}
	return d
}

// ReadStatus reads the outbox's backlog per shard, the oldest pending age,
// and the dead letters and retries waiting.
func ReadStatus(ctx context.Context, db DBTX, schema string) (OutboxStatus, error) {
	if err := sqlident.Validate("schema", schema); err != nil {
		return OutboxStatus{}, err
	}
	shards, err := ReadShardCount(ctx, db, schema)
	if err != nil {
		return OutboxStatus{}, err
	}
	var st OutboxStatus
	for shard := 0; shard < shards; shard++ {
		messages := sqlident.Qualify(schema, outbox.Table(shard))
		offsets := sqlident.Qualify(schema, outbox.OffsetsTable(shard))
		ss := ShardStatus{Shard: shard}
		var oldest float64
		err := db.QueryRow(ctx, `SELECT
				count(*) FILTER (WHERE o.consumer_group IS NULL OR (m.transaction_id, m."offset") > (o.last_processed_transaction_id, o.offset_acked)),
				COALESCE(EXTRACT(EPOCH FROM LOCALTIMESTAMP - min(m.created_at) FILTER (
					WHERE o.consumer_group IS NULL OR (m.transaction_id, m."offset") > (o.last_processed_transaction_id, o.offset_acked))), 0),
				count(*)
			FROM `+messages+` m LEFT JOIN `+offsets+` o ON o.consumer_group = $1`, outbox.RelayConsumerGroup).
			Scan(&ss.Backlog, &oldest, &ss.Stored)
		if err != nil {
			return st, fmt.Errorf("read shard %d status: %w", shard, err)
		}
		ss.OldestPending = time.Duration(max(oldest, 0) * float64(time.Second))
		c, err := checkPosition(ctx, db, schema, shard)
		if err != nil {
			return st, err
		}
		ss.PositionAhead = c.Ahead()
		st.Shards = append(st.Shards, ss)
	}
	err = db.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM `+sqlident.Qualify(schema, "dead_letters")+` WHERE replayed_at IS NULL),
			(SELECT count(*) FROM `+sqlident.Qualify(schema, "relay_failures")+`)`).Scan(&st.DeadLetters, &st.Retrying)
	if err != nil {
		return st, fmt.Errorf("read dead letters: %w", err)
	}
	return st, nil
}

// statusCollector reports ReadStatus at scrape time.
type statusCollector struct {
	db      DBTX
	schema  string
	timeout time.Duration

	backlog, oldest, stored, dead, retrying, up, ahead *prometheus.Desc
}

// NewStatusCollector returns a Prometheus collector that reads the outbox
// status from the database on every scrape: eventline_outbox_backlog,
// eventline_outbox_oldest_pending_seconds, stored rows and
// eventline_outbox_position_ahead (1 when the shard needs
// RebasePositions) per shard, dead letters waiting, rows waiting for a
// retry, and eventline_outbox_up (0 when the status could not be read).
func NewStatusCollector(db DBTX, schema string) prometheus.Collector {
	shard := []string{"shard"}
	return &statusCollector{
		db: db, schema: schema, timeout: 5 * time.Second,
		backlog:  prometheus.NewDesc("eventline_outbox_backlog", "Committed outbox rows not yet forwarded to Kafka.", shard, nil),
		oldest:   prometheus.NewDesc("eventline_outbox_oldest_pending_seconds", "Age of the oldest row not yet forwarded.", shard, nil),
		stored:   prometheus.NewDesc("eventline_outbox_stored_rows", "Rows in the shard's table, forwarded or not.", shard, nil),
		dead:     prometheus.NewDesc("eventline_outbox_dead_letters", "Dead letters not yet replayed.", nil, nil),
		retrying: prometheus.NewDesc("eventline_outbox_retrying", "Rows that failed to publish and wait for a retry.", nil, nil),
		up:       prometheus.NewDesc("eventline_outbox_up", "1 if the outbox status could be read.", nil, nil),
		ahead: prometheus.NewDesc("eventline_outbox_position_ahead",
			"1 when the shard's position or rows carry transaction ids this cluster has not handed out: run `eventline relay rebase-positions`.", shard, nil),
	}
}

func (c *statusCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.backlog, c.oldest, c.stored, c.dead, c.retrying, c.up, c.ahead} {
		ch <- d
	}
}

func (c *statusCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	st, err := ReadStatus(ctx, c.db, c.schema)
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
	}
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, float64(st.DeadLetters))
	ch <- prometheus.MustNewConstMetric(c.retrying, prometheus.GaugeValue, float64(st.Retrying))
}
