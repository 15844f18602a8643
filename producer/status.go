package producer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventline/eventline/internal/nilcheck"
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
	// HeldBack counts committed rows of the backlog that relays cannot read
	// yet because an older transaction is still open (the xmin horizon):
	// see OutboxStatus.HorizonHolder.
	HeldBack int64
}

// OutboxStatus is a snapshot of the outbox read from the database.
type OutboxStatus struct {
	Shards []ShardStatus
	// DeadLetters counts dead letters not yet replayed.
	DeadLetters int64
	// Retrying counts rows that failed to publish and wait for a retry.
	Retrying int64
	// HorizonHolder is the oldest open transaction holding a transaction
	// id, which keeps committed rows from the relays, when some shard has
	// rows held back (HeldBack); nil otherwise.
	HorizonHolder *HorizonHolder
}

// HorizonHolder describes the transaction holding PostgreSQL's xmin
// horizon: the relays read only rows of transactions older than every open
// one, so while it stays open, newer committed events wait. End it (commit,
// roll back, or pg_terminate_backend(PID)) and they flow again.
type HorizonHolder struct {
	// PID is its backend's process id (0 for a prepared transaction).
	PID int32
	// Xid is its transaction id; BackendXmin its snapshot's xmin, if any.
	Xid, BackendXmin string
	// XactAge is how long the transaction has been open.
	XactAge time.Duration
	// QueryStart is when its current or last statement started.
	QueryStart *time.Time
	// State is pg_stat_activity.state (e.g. "idle in transaction").
	State string
	// ApplicationName and Database say whose it is; Query is its current
	// or last statement, when the role reading it may see it.
	ApplicationName, Database, Query string
	// PreparedGID is set for a prepared (two-phase) transaction.
	PreparedGID string
}

// horizonHolderSQL finds the oldest transaction holding a transaction id,
// open or prepared, anywhere in the cluster.
const horizonHolderSQL = `SELECT pid, xid, xmin, age_s, query_start, state, app, db, query, gid FROM (
		SELECT pid, backend_xid::text AS xid, COALESCE(backend_xmin::text, '') AS xmin, age(backend_xid) AS xid_age,
			EXTRACT(EPOCH FROM clock_timestamp() - xact_start)::float8 AS age_s, query_start, COALESCE(state, '') AS state,
			COALESCE(application_name, '') AS app, COALESCE(datname, '') AS db, left(COALESCE(query, ''), 200) AS query, '' AS gid
		FROM pg_stat_activity WHERE backend_xid IS NOT NULL
		UNION ALL
		SELECT 0, transaction::text, '', age(transaction), EXTRACT(EPOCH FROM clock_timestamp() - prepared)::float8, NULL,
			'prepared', '', database, '', gid
		FROM pg_prepared_xacts
	) t ORDER BY xid_age DESC LIMIT 1`

// ReadHorizonHolder returns the oldest transaction holding a transaction
// id in the cluster, or nil when there is none.
func ReadHorizonHolder(ctx context.Context, db DBTX) (*HorizonHolder, error) {
	if nilcheck.IsNil(db) {
		return nil, nilDB("ReadHorizonHolder", "db")
	}
	var h HorizonHolder
	var age float64
	err := db.QueryRow(ctx, horizonHolderSQL).Scan(&h.PID, &h.Xid, &h.BackendXmin, &age, &h.QueryStart, &h.State, &h.ApplicationName, &h.Database, &h.Query, &h.PreparedGID)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the transaction holding the xmin horizon: %w", err)
	}
	h.XactAge = time.Duration(max(age, 0) * float64(time.Second))
	return &h, nil
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
	if nilcheck.IsNil(db) {
		return OutboxStatus{}, nilDB("ReadStatus", "db")
	}
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
				count(*),
				count(*) FILTER (WHERE (o.consumer_group IS NULL OR (m.transaction_id, m."offset") > (o.last_processed_transaction_id, o.offset_acked))
					AND m.transaction_id >= pg_snapshot_xmin(pg_current_snapshot()))
			FROM `+messages+` m LEFT JOIN `+offsets+` o ON o.consumer_group = $1`, outbox.RelayConsumerGroup).
			Scan(&ss.Backlog, &oldest, &ss.Stored, &ss.HeldBack)
		if err != nil {
			return st, fmt.Errorf("read shard %d status: %w", shard, err)
		}
		ss.OldestPending = time.Duration(max(oldest, 0) * float64(time.Second))
		c, err := checkPosition(ctx, db, schema, shard)
		if err != nil {
			return st, err
		}
		ss.PositionAhead = c.Ahead()
		if ss.PositionAhead {
			ss.HeldBack = 0 // not the horizon: see PositionAhead
		}
		st.Shards = append(st.Shards, ss)
		if ss.HeldBack > 0 && st.HorizonHolder == nil {
			if st.HorizonHolder, err = ReadHorizonHolder(ctx, db); err != nil {
				return st, err
			}
		}
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
		heldBack: prometheus.NewDesc("eventline_outbox_held_back",
			"Committed rows the relays cannot read yet because an older transaction is open (the xmin horizon).", shard, nil),
		holderAge: prometheus.NewDesc("eventline_outbox_horizon_holder_age_seconds",
			"While rows are held back: how long the oldest open transaction (the one holding the xmin horizon) has been open.", nil, nil),
		holderPID: prometheus.NewDesc("eventline_outbox_horizon_holder_pid",
			"While rows are held back: the backend pid of the oldest open transaction (0 for a prepared one); see pg_stat_activity or eventline status.", nil, nil),
	}
}

func (c *statusCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.backlog, c.oldest, c.stored, c.dead, c.retrying, c.up, c.ahead, c.heldBack, c.holderAge, c.holderPID} {
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
		ch <- prometheus.MustNewConstMetric(c.heldBack, prometheus.GaugeValue, float64(s.HeldBack), label)
	}
	if h := st.HorizonHolder; h != nil {
		ch <- prometheus.MustNewConstMetric(c.holderAge, prometheus.GaugeValue, h.XactAge.Seconds())
		ch <- prometheus.MustNewConstMetric(c.holderPID, prometheus.GaugeValue, float64(h.PID))
	}
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, float64(st.DeadLetters))
	ch <- prometheus.MustNewConstMetric(c.retrying, prometheus.GaugeValue, float64(st.Retrying))
}
