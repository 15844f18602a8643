package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// DistinctGroups returns the distinct consumer_group values of table's
// rows that match the condition and (AND …, or ""), as a subquery
// rendered for {schema}, by skipping from one group to the next along its
// index: the cost grows with the groups, not the rows.
func DistinctGroups(table, and string) string {
	return `(WITH RECURSIVE g(name) AS (
		(SELECT consumer_group FROM {schema}.` + table + ` WHERE true ` + and + ` ORDER BY consumer_group LIMIT 1)
		UNION ALL
		SELECT (SELECT consumer_group FROM {schema}.` + table + ` WHERE consumer_group > g.name ` + and + ` ORDER BY consumer_group LIMIT 1)
		FROM g WHERE g.name IS NOT NULL
	) SELECT name FROM g WHERE name IS NOT NULL)`
}

// recordingGroupsSQL lists the groups with dedup records or versions.
var recordingGroupsSQL = statement(`SELECT name FROM (` + DistinctGroups("processed_events", "") + ` UNION ` +
	DistinctGroups("aggregate_versions", "") + `) g ORDER BY name`)

// RecordingGroups lists, by name, the consumer groups with dedup records
// or aggregate versions: every group that handled an event.
func (s *Store) RecordingGroups(ctx context.Context, db DBTX) ([]string, error) {
	rows, err := db.Query(ctx, s.q(recordingGroupsSQL))
	if err != nil {
		return nil, fmt.Errorf("list the consumer groups: %w", err)
	}
	groups, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list the consumer groups: %w", err)
	}
	return groups, nil
}
