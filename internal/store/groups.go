package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

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
