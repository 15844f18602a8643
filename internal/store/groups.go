package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// SkippedWindow is the window admin.GroupStatus.SkippedGapsRecent counts
// over.
const SkippedWindow = 24 * time.Hour

// The status of the consumer groups is read by package admin, which owns
// its types (admin.GroupStatus) and scans the rows these methods return:
// the statements stay here.

// distinctGroups returns the distinct consumer_group values of table's
// rows that match the condition and (AND …, or ""), by skipping from one
// group to the next along its index: the cost grows with the groups, not
// the rows.
func distinctGroups(table, and string) string {
	return `(WITH RECURSIVE g(name) AS (
		(SELECT consumer_group FROM {schema}.` + table + ` WHERE true ` + and + ` ORDER BY consumer_group LIMIT 1)
		UNION ALL
		SELECT (SELECT consumer_group FROM {schema}.` + table + ` WHERE consumer_group > g.name ` + and + ` ORDER BY consumer_group LIMIT 1)
		FROM g WHERE g.name IS NOT NULL
	) SELECT name FROM g WHERE name IS NOT NULL)`
}

// openHeldSQL counts group $1's open held events of one kind.
func openHeldSQL(kind string) string {
	return `(SELECT count(*) FROM {schema}.held_events WHERE consumer_group = $1 AND kind = '` + kind + `' AND status IN ('held', 'replay_requested'))`
}

var (
	// statusGroupsSQL lists the consumer groups that recorded a version
	// or a parked event, or hold an open event (the relay's have no
	// group), each along its table's index.
	statusGroupsSQL = statement(`SELECT name FROM (` + distinctGroups("aggregate_versions", "") + ` UNION ` + distinctGroups("parked_events", "") +
		` UNION ` + distinctGroups("held_events", `AND status IN ('held', 'replay_requested') AND consumer_group <> ''`) + `) g ORDER BY name`)
	// processedGroupsSQL lists the groups with dedup records.
	processedGroupsSQL = statement(`SELECT name FROM ` + distinctGroups("processed_events", "") + ` g`)
	// recordingGroupsSQL lists the groups with dedup records or versions.
	recordingGroupsSQL = statement(`SELECT name FROM (` + distinctGroups("processed_events", "") + ` UNION ` +
		distinctGroups("aggregate_versions", "") + `) g ORDER BY name`)
	// statusCountsSQL counts a group's parked, skipped, late and dead ($1
	// group, $2 the skipped window in microseconds).
	statusCountsSQL = statement(`SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(parked_at)), 0)::float8,
			(SELECT count(*) FROM {schema}.skipped_versions WHERE consumer_group = $1 AND skipped_at > now() - $2::bigint * interval '1 microsecond'),
			` + openHeldSQL("late") + `, ` + openHeldSQL("dead_letter") + `
		FROM {schema}.parked_events WHERE consumer_group = $1`)
	// skippedTotalsSQL counts the gaps group $1 skipped and the versions
	// in them.
	skippedTotalsSQL = statement(`SELECT count(*), COALESCE(sum(to_version - from_version + 1), 0)::bigint
		FROM {schema}.skipped_versions WHERE consumer_group = $1`)
	// Per aggregate with parked events: the lowest one, the predecessor
	// it waits for and the aggregate's version; a gap is open when that
	// predecessor has not been applied ($1 group, $2 limit).
	openGapsSQL = statement(`SELECT aggregate_type, aggregate_id, current, follows, head, n, age, count(*) OVER () FROM (
			SELECT p.aggregate_type, p.aggregate_id, COALESCE(av.version, 0) AS current, p.follows, p.head, p.n,
				EXTRACT(EPOCH FROM now() - p.oldest)::float8 AS age, p.oldest
			FROM (SELECT aggregate_type, aggregate_id, min(aggregate_version) AS head, count(*) AS n, min(parked_at) AS oldest,
					(array_agg(previous_version ORDER BY aggregate_version))[1] AS follows
				FROM {schema}.parked_events WHERE consumer_group = $1 GROUP BY aggregate_type, aggregate_id) p
			LEFT JOIN {schema}.aggregate_versions av ON av.consumer_group = $1 AND av.aggregate_type = p.aggregate_type AND av.aggregate_id = p.aggregate_id
			WHERE p.follows > COALESCE(av.version, 0)
		) g ORDER BY oldest, aggregate_type, aggregate_id LIMIT greatest($2::bigint, 1)`)
)

// StatusGroups lists, by name, the consumer groups that recorded a
// version or a parked event, or hold an open late event or dead letter.
func (s *Store) StatusGroups(ctx context.Context, db DBTX) ([]string, error) {
	return s.groups(ctx, db, statusGroupsSQL, "eventline: list consumer groups")
}

// ProcessedGroups lists, by name, the consumer groups with dedup records,
// skipping along the primary key from one group to the next, so the cost
// grows with the groups, not the rows.
func (s *Store) ProcessedGroups(ctx context.Context, db DBTX) ([]string, error) {
	return s.groups(ctx, db, processedGroupsSQL, "list the consumer groups with dedup records")
}

// RecordingGroups lists, by name, the consumer groups with dedup records
// or aggregate versions: every group that handled an event.
func (s *Store) RecordingGroups(ctx context.Context, db DBTX) ([]string, error) {
	return s.groups(ctx, db, recordingGroupsSQL, "list the consumer groups")
}

func (s *Store) groups(ctx context.Context, db DBTX, st stmt, what string) ([]string, error) {
	rows, err := db.Query(ctx, s.q(st))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	groups, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return groups, nil
}

// GroupCounts returns the row of the group's parked events, the oldest
// one's age in seconds (float8), the gaps it skipped in the last
// SkippedWindow, and its open late events and dead letters.
func (s *Store) GroupCounts(ctx context.Context, db DBTX, group string) pgx.Row {
	return db.QueryRow(ctx, s.q(statusCountsSQL), group, SkippedWindow.Microseconds())
}

// OpenGaps returns the rows of up to limit (at least one) of the group's
// open gaps, the oldest first: aggregate type and id, its version, the
// version its lowest parked event follows, that event's version, the
// aggregate's parked events, the gap's age in seconds (float8) and the
// number of open gaps of the group.
func (s *Store) OpenGaps(ctx context.Context, db DBTX, group string, limit int) (pgx.Rows, error) {
	return db.Query(ctx, s.q(openGapsSQL), group, limit)
}

// SkippedTotals returns how many gaps the group skipped, ever, and the
// versions in them.
func (s *Store) SkippedTotals(ctx context.Context, db DBTX, group string) (gaps, versions int64, err error) {
	if err := db.QueryRow(ctx, s.q(skippedTotalsSQL), group).Scan(&gaps, &versions); err != nil {
		return 0, 0, fmt.Errorf("read the skipped gaps of group %q: %w", group, err)
	}
	return gaps, versions, nil
}
