package verify

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements on the consumer tables, written with {schema} for
// Config.ConsumerSchema and rendered by runner.consumerSQL. Those that
// read a window take it as $1 (since) and $2 (until), and the groups as
// $3.

// tablesPresentSQL reports whether the consumer tables exist.
const tablesPresentSQL = `SELECT to_regclass('{schema}.processed_events') IS NOT NULL AND to_regclass('{schema}.skipped_versions') IS NOT NULL`

// parkedTopicsSQL lists the topics each group ($1) has parked events of.
const parkedTopicsSQL = `SELECT DISTINCT consumer_group, topic FROM {schema}.parked_events WHERE consumer_group = ANY($1) AND topic <> ''`

// each runs query and calls fn with each row, scanned by position into a
// T: a struct whose exported fields (those of embedded structs included)
// are the columns, in order. Its errors say what was read.
func each[T any](ctx context.Context, tx pgx.Tx, what string, fn func(T), query string, args ...any) error {
	rows, err := tx.Query(ctx, query, args...)
	if err == nil {
		defer rows.Close()
		for rows.Next() {
			var row T
			if row, err = pgx.RowToStructByPos[T](rows); err != nil {
				break
			}
			fn(row)
		}
		if err == nil {
			err = rows.Err()
		}
	}
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

// groupTopic is a topic a group consumes.
type groupTopic struct{ Group, Topic string }

// eventRow names the event a row of a consumer table (or of held_events)
// is about: the first columns of every query below that reads one, in
// this order, At being when the row was written (parked, held, applied).
type eventRow struct {
	Group, AggregateType, AggregateID, EventID, EventType string
	Version                                               int64
	At                                                    time.Time
}

// finding is a finding about the row's event, its age measured against
// now (the clock of the row's database).
func (e eventRow) finding(sev Severity, kind Kind, now time.Time, detail string) Finding {
	at := e.At
	return Finding{Severity: sev, Kind: kind, Group: e.Group, EventID: e.EventID, EventType: e.EventType,
		AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.Version,
		At: &at, AgeSeconds: max(now.Sub(at), 0).Seconds(), Detail: detail}
}

// eventColumnsOf lists eventRow's columns of a table with alias t, At
// being the column at.
func eventColumnsOf(t, at string) string {
	return t + `.consumer_group, ` + t + `.aggregate_type, ` + t + `.aggregate_id, ` + t + `.event_id, ` + t + `.event_type, ` +
		t + `.aggregate_version, ` + t + `.` + at
}

// inferTopicsSQL returns, per group, the topics of the events of the
// relation eventsSQL it has dedup records of. $p is the groups array.
func inferTopicsSQL(eventsSQL string, p int) string {
	return `SELECT DISTINCT pe.consumer_group, ev.topic FROM (` + eventsSQL + `) ev
		JOIN {schema}.processed_events pe ON pe.consumer_group = ANY($` + fmt.Sprint(p) + `) AND pe.event_id = ev.event_id
			AND pe.aggregate_type = ev.aggregate_type AND pe.aggregate_id = ev.aggregate_id`
}

// parkedRow is a parked event and its aggregate's current version (0:
// none yet).
type parkedRow struct {
	eventRow
	Follows   int64
	Attempts  int
	LastError string
	Current   int64
}

// parkedSQL reads the parked events of the window, as parkedRow.
var parkedSQL = `SELECT ` + eventColumnsOf("pe", "parked_at") + `, pe.previous_version, pe.release_attempts, COALESCE(pe.last_error, ''), COALESCE(av.version, 0)
	FROM {schema}.parked_events pe LEFT JOIN {schema}.aggregate_versions av
		ON av.consumer_group = pe.consumer_group AND av.aggregate_type = pe.aggregate_type AND av.aggregate_id = pe.aggregate_id
	WHERE pe.consumer_group = ANY($3) AND ` + windowSQL("pe.parked_at")

// heldRow is a held event: its id, why it was held (Cause: its kind for
// a dead letter), whether its replay was requested, and for the relay's
// dead letters (whose group is empty) the shard, the topic, the last
// error and the attempts.
type heldRow struct {
	eventRow
	ID        int64
	Cause     string
	Reason    string
	Requested bool
	Shard     int
	Topic     string
	LastError string
	Attempts  int
}

// heldSQL reads the groups' held events of kind held in the window in one
// of the statuses, oldest first, as heldRow (the relay's group is "").
func heldSQL(kind, statuses string) string {
	return `SELECT ` + eventColumnsOf("h", "held_at") + `, h.id, h.cause, h.reason, h.status = 'replay_requested',
			coalesce(h.shard, 0), h.topic, coalesce(h.last_error, ''), h.attempts
		FROM {schema}.held_events h WHERE h.kind = '` + kind + `' AND h.status IN (` + statuses + `) AND h.consumer_group = ANY($3) AND ` +
		windowSQL("h.held_at") + ` ORDER BY h.held_at, h.id`
}

// open are the statuses of held events still waiting (heldSQL).
const open = `'held', 'replay_requested'`

// skippedRow is a range of versions a group skipped.
type skippedRow struct {
	Group, AggregateType, AggregateID string
	From, To                          int64
	Reason                            string
	At                                time.Time
}

// skippedSQL reads the skipped ranges recorded in the window, as
// skippedRow.
var skippedSQL = `SELECT consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason, skipped_at
	FROM {schema}.skipped_versions WHERE consumer_group = ANY($3) AND ` + windowSQL("skipped_at") + ` ORDER BY id`

// versionRow is an applied event and the other version it is checked
// against: the higher one applied before it (out of order) or, for a
// discarded event, the event that had applied its version.
type versionRow[T any] struct {
	eventRow
	Other T
}

// aggregateWindow partitions processed_events rows by group and aggregate.
// The byte-wise collation only makes the sort cheaper: the partitions are
// the same.
const aggregateWindow = `PARTITION BY p.consumer_group COLLATE "C", p.aggregate_type COLLATE "C", p.aggregate_id COLLATE "C"`

// outOfOrderSQL finds applied events (processed in the window) that were
// applied after a higher version of their aggregate. eventline records
// two clocks per event: processed_at, when it was first handled (a parked
// event keeps the time it was parked), and the transaction that last
// wrote its dedup row (xmin; releasing a parked event rewrites its row in
// the transaction that applies it). An event counts as out of order only
// when a higher version came strictly earlier by both, so an event
// released from parking right after its predecessor is not reported. Ties
// (one transaction applying several versions) are ordered by version, so
// they never count; the running maxima keep the cost one sort per clock,
// however many events an aggregate has.
var outOfOrderSQL = `SELECT ` + eventColumnsOf("s", "processed_at") + `, s.before_t
	FROM (
		SELECT p.consumer_group, p.aggregate_type, p.aggregate_id, p.aggregate_version, p.event_id, p.event_type, p.processed_at,
			max(p.aggregate_version) OVER (` + aggregateWindow + ` ORDER BY p.processed_at, p.aggregate_version
				ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_t,
			max(p.aggregate_version) OVER (` + aggregateWindow + ` ORDER BY age(p.xmin) DESC, p.aggregate_version
				ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_x
		FROM {schema}.processed_events p
		WHERE p.consumer_group = ANY($3) AND p.outcome = 'applied' AND p.aggregate_version > 0 AND ` + windowSQL("p.processed_at") + `
	) s
	WHERE s.aggregate_version < s.before_t AND s.aggregate_version < s.before_x`

// discardedSQL finds events discarded as stale in the window while
// another event, with another id, was applied at their aggregate version:
// a second event claiming a version (a producer whose sequence fell behind
// what consumers had seen, as after a failover that lost commits), of
// which only the first applied. A stale event whose version no other
// event of the group applied is a redelivery whose dedup record expired,
// or one whose other event's record expired: nothing to say. It returns
// one row per discarded event, with the smallest of the other ids.
var discardedSQL = `SELECT ` + eventColumnsOf("s", "processed_at") + `, min(a.event_id)
	FROM {schema}.processed_events s
	JOIN {schema}.processed_events a ON a.consumer_group = s.consumer_group AND a.aggregate_type = s.aggregate_type
		AND a.aggregate_id = s.aggregate_id AND a.aggregate_version = s.aggregate_version
		AND a.outcome IN ('applied', 'late_applied') AND a.event_id <> s.event_id
	WHERE s.consumer_group = ANY($3) AND s.outcome = 'stale' AND s.aggregate_version > 0 AND ` + windowSQL("s.processed_at") + `
	GROUP BY s.consumer_group, s.aggregate_type, s.aggregate_id, s.aggregate_version, s.event_id, s.event_type, s.processed_at`
