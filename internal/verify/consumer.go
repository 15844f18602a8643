package verify

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/sqlident"
)

// ConsumerDeadLetterTable is where verify reads the consumer groups' dead
// letters: held_events, kind dead_letter (migration 003_held_events).
const ConsumerDeadLetterTable = "held_events"

// consumerSQL names the consumer tables in their schema.
type consumerSQL struct {
	schema                                     string
	processed, versions, parked, skipped, held string
}

// deadRecord is one consumer dead letter.
type deadRecord struct {
	id                                             int64
	eventID, eventType, aggregateType, aggregateID string
	version                                        int64
	group, reason                                  string
	at                                             time.Time
}

func newConsumerSQL(schema string) consumerSQL {
	return consumerSQL{
		schema:    schema,
		processed: sqlident.Qualify(schema, "processed_events"),
		versions:  sqlident.Qualify(schema, "aggregate_versions"),
		parked:    sqlident.Qualify(schema, "parked_events"),
		skipped:   sqlident.Qualify(schema, "skipped_versions"),
		held:      sqlident.Qualify(schema, ConsumerDeadLetterTable),
	}
}

// tablesPresent reports whether the consumer tables exist.
func (q consumerSQL) tablesPresent(ctx context.Context, tx pgx.Tx) (bool, error) {
	var ok bool
	err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL`, q.processed, q.skipped).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("look for the consumer tables in schema %s: %w", q.schema, err)
	}
	return ok, nil
}

// discoverGroups lists the consumer groups that recorded anything, by a
// loose index scan of the two tables whose primary key starts with the
// group: cheap however many rows there are.
func (q consumerSQL) discoverGroups(ctx context.Context, tx pgx.Tx) ([]string, error) {
	var out []string
	for _, table := range []string{q.processed, q.versions} {
		rows, err := tx.Query(ctx, `WITH RECURSIVE g(name) AS (
			(SELECT consumer_group FROM `+table+` ORDER BY consumer_group LIMIT 1)
			UNION ALL
			SELECT (SELECT consumer_group FROM `+table+` WHERE consumer_group > g.name ORDER BY consumer_group LIMIT 1)
			FROM g WHERE g.name IS NOT NULL
		) SELECT name FROM g WHERE name IS NOT NULL`)
		if err != nil {
			return nil, fmt.Errorf("list consumer groups in %s: %w", table, err)
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, fmt.Errorf("list consumer groups in %s: %w", table, err)
		}
		out = append(out, names...)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// hasRecords reports whether the group has any dedup record.
func (q consumerSQL) hasRecords(ctx context.Context, tx pgx.Tx, group string) (bool, error) {
	var ok bool
	err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+q.processed+` WHERE consumer_group = $1)`, group).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("read dedup records of group %q: %w", group, err)
	}
	return ok, nil
}

// parkedTopics returns the topics each group has parked events of.
func (q consumerSQL) parkedTopics(ctx context.Context, tx pgx.Tx, groups []string, into map[string]map[string]bool) error {
	rows, err := tx.Query(ctx, `SELECT DISTINCT consumer_group, topic FROM `+q.parked+` WHERE consumer_group = ANY($1) AND topic <> ''`, groups)
	if err != nil {
		return fmt.Errorf("read parked events' topics: %w", err)
	}
	var g, t string
	_, err = pgx.ForEachRow(rows, []any{&g, &t}, func() error {
		addTopic(into, g, t)
		return nil
	})
	return err
}

// queryEach runs query and calls fn for each row, scanned into scans. Its
// errors say what was read.
func queryEach(ctx context.Context, tx pgx.Tx, what string, scans []any, fn func(), query string, args ...any) error {
	rows, err := tx.Query(ctx, query, args...)
	if err == nil {
		_, err = pgx.ForEachRow(rows, scans, func() error { fn(); return nil })
	}
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

func addTopic(m map[string]map[string]bool, group, topic string) {
	if m[group] == nil {
		m[group] = map[string]bool{}
	}
	m[group][topic] = true
}

// inferTopicsSQL returns, per group, the topics of the events of the
// relation eventsSQL it has dedup records of. $p is the groups array.
func (q consumerSQL) inferTopicsSQL(eventsSQL string, p int) string {
	return `SELECT DISTINCT pe.consumer_group, ev.topic FROM (` + eventsSQL + `) ev
		JOIN ` + q.processed + ` pe ON pe.consumer_group = ANY($` + fmt.Sprint(p) + `) AND pe.event_id = ev.event_id
			AND pe.aggregate_type = ev.aggregate_type AND pe.aggregate_id = ev.aggregate_id`
}

// readParked calls fn for each parked event of the groups in the window,
// with the aggregate's current version.
func (q consumerSQL) readParked(ctx context.Context, tx pgx.Tx, groups []string, w window,
	fn func(group, typ, id, eventID, eventType string, version, follows int64, parkedAt time.Time, attempts int, lastErr string, current *int64)) error {
	var (
		group, typ, id, eventID, eventType, lastErr string
		version, prev                               int64
		parkedAt                                    time.Time
		attempts                                    int
		current                                     *int64
	)
	return queryEach(ctx, tx, "read parked events", []any{&group, &typ, &id, &eventID, &eventType, &version, &prev, &parkedAt, &attempts, &lastErr, &current}, func() { fn(group, typ, id, eventID, eventType, version, prev, parkedAt, attempts, lastErr, current) },
		`SELECT pe.consumer_group, pe.aggregate_type, pe.aggregate_id, pe.event_id, pe.event_type,
			pe.aggregate_version, pe.previous_version, pe.parked_at, pe.release_attempts, COALESCE(pe.last_error, ''), av.version
		FROM `+q.parked+` pe LEFT JOIN `+q.versions+` av
			ON av.consumer_group = pe.consumer_group AND av.aggregate_type = pe.aggregate_type AND av.aggregate_id = pe.aggregate_id
		WHERE pe.consumer_group = ANY($3) AND `+windowSQL("pe.parked_at", 1, 2), w.since, w.until, groups)
}

// readLate calls fn for each late event of the groups held in the window
// and still open. kind is its cause.
func (q consumerSQL) readLate(ctx context.Context, tx pgx.Tx, groups []string, w window,
	fn func(group, typ, id, eventID, eventType string, version int64, kind, reason string, heldAt time.Time, applyRequested bool)) error {
	var (
		group, typ, id, eventID, eventType, kind, reason string
		version                                          int64
		heldAt                                           time.Time
		requested                                        bool
	)
	return queryEach(ctx, tx, "read late events", []any{&group, &typ, &id, &eventID, &eventType, &version, &kind, &reason, &heldAt, &requested}, func() { fn(group, typ, id, eventID, eventType, version, kind, reason, heldAt, requested) },
		`SELECT consumer_group, aggregate_type, aggregate_id, event_id, event_type, aggregate_version, cause, reason, held_at,
			status = 'replay_requested'
		FROM `+q.held+` WHERE kind = 'late' AND status IN ('held', 'replay_requested') AND consumer_group = ANY($3) AND `+
			windowSQL("held_at", 1, 2)+` ORDER BY held_at`, w.since, w.until, groups)
}

// readSkipped calls fn for each skipped range of the groups in the window.
func (q consumerSQL) readSkipped(ctx context.Context, tx pgx.Tx, groups []string, w window,
	fn func(group, typ, id string, from, to int64, reason string, at time.Time)) error {
	var (
		group, typ, id, reason string
		from, to               int64
		at                     time.Time
	)
	return queryEach(ctx, tx, "read skipped versions", []any{&group, &typ, &id, &from, &to, &reason, &at}, func() { fn(group, typ, id, from, to, reason, at) },
		`SELECT consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason, skipped_at
		FROM `+q.skipped+` WHERE consumer_group = ANY($3) AND `+windowSQL("skipped_at", 1, 2)+` ORDER BY id`, w.since, w.until, groups)
}

// aggregateWindow partitions processed_events rows by group and aggregate.
// The byte-wise collation only makes the sort cheaper: the partitions are
// the same.
const aggregateWindow = `PARTITION BY p.consumer_group COLLATE "C", p.aggregate_type COLLATE "C", p.aggregate_id COLLATE "C"`

// outOfOrderSQL finds applied events of the groups ($3, processed in the
// window $1..$2) that were applied after a higher version of their
// aggregate. eventline records two clocks per event: processed_at, when it
// was first handled (a parked event keeps the time it was parked), and the
// transaction that last wrote its dedup row (xmin; releasing a parked event
// rewrites its row in the transaction that applies it). An event counts as
// out of order only when a higher version came strictly earlier by both, so
// an event released from parking right after its predecessor is not
// reported. Ties (one transaction applying several versions) are ordered
// by version, so they never count; the running maxima keep the cost one
// sort per clock, however many events an aggregate has.
func (q consumerSQL) outOfOrderSQL() string {
	return `SELECT consumer_group, aggregate_type, aggregate_id, aggregate_version, event_id, event_type, processed_at, before_t
	FROM (
		SELECT p.consumer_group, p.aggregate_type, p.aggregate_id, p.aggregate_version, p.event_id, p.event_type, p.processed_at,
			max(p.aggregate_version) OVER (` + aggregateWindow + ` ORDER BY p.processed_at, p.aggregate_version
				ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_t,
			max(p.aggregate_version) OVER (` + aggregateWindow + ` ORDER BY age(p.xmin) DESC, p.aggregate_version
				ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_x
		FROM ` + q.processed + ` p
		WHERE p.consumer_group = ANY($3) AND p.outcome = 'applied' AND p.aggregate_version > 0 AND ` + windowSQL("p.processed_at", 1, 2) + `
	) s
	WHERE aggregate_version < before_t AND aggregate_version < before_x`
}

// discardedSQL finds events of the groups ($3) discarded as stale in the
// window ($1..$2) while another event, with another id, was applied at
// their aggregate version: a second event claiming a version (a producer
// whose sequence fell behind what consumers had seen, as after a failover
// that lost commits), of which only the first applied. A stale event whose
// version no other event of the group applied is a redelivery whose dedup
// record expired, or one whose other event's record expired: nothing to
// say. It returns one row per discarded event, with the smallest of the
// other ids.
func (q consumerSQL) discardedSQL() string {
	return `SELECT s.consumer_group, s.aggregate_type, s.aggregate_id, s.aggregate_version, s.event_id, s.event_type, s.processed_at, min(a.event_id)
	FROM ` + q.processed + ` s
	JOIN ` + q.processed + ` a ON a.consumer_group = s.consumer_group AND a.aggregate_type = s.aggregate_type
		AND a.aggregate_id = s.aggregate_id AND a.aggregate_version = s.aggregate_version
		AND a.outcome IN ('applied', 'late_applied') AND a.event_id <> s.event_id
	WHERE s.consumer_group = ANY($3) AND s.outcome = 'stale' AND s.aggregate_version > 0 AND ` + windowSQL("s.processed_at", 1, 2) + `
	GROUP BY s.consumer_group, s.aggregate_type, s.aggregate_id, s.aggregate_version, s.event_id, s.event_type, s.processed_at`
}

// readConsumerDeadLetters calls fn for each dead letter of the groups
// neither replayed nor discarded, held in the window.
func (q consumerSQL) readConsumerDeadLetters(ctx context.Context, tx pgx.Tx, groups []string, w window, fn func(deadRecord)) error {
	var d deadRecord
	return queryEach(ctx, tx, "read the consumer dead letters", []any{&d.id, &d.group, &d.eventID, &d.eventType, &d.aggregateType, &d.aggregateID, &d.version, &d.reason, &d.at}, func() { fn(d) },
		`SELECT id, consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, reason, held_at
		FROM `+q.held+` WHERE kind = 'dead_letter' AND status IN ('held', 'replay_requested') AND consumer_group = ANY($3) AND `+
			windowSQL("held_at", 1, 2), w.since, w.until, groups)
}
