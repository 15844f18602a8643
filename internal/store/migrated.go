package store

import (
	"context"
	"fmt"
)

// migratedSQL asks whether held_events exists, and whether
// processed_events is keyed by aggregate (007_dedup_scope). held_events is
// created by the newest migration that adds a consumer table
// (003_held_events); the migrations run in order, so its presence implies
// every earlier consumer table.
var migratedSQL = statement(`SELECT to_regclass('{schema}.held_events') IS NOT NULL,
	EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
		WHERE i.indrelid = to_regclass('{schema}.processed_events') AND i.indisprimary AND a.attname = 'aggregate_id')`)

// Unmigrated says what the schema lacks of the consumer tables
// (processed_events, aggregate_versions, parked events, held events) or of their newest shape (007_dedup_scope: dedup records keyed
// by aggregate), and what to run; "" when they are there. Without them
// every event would fail on a missing table, or be deduplicated by the old
// key. err reports a failed query.
func (s *Store) Unmigrated(ctx context.Context, db DBTX) (problem string, err error) {
	var present, scoped bool
	if err := db.QueryRow(ctx, s.q(migratedSQL)).Scan(&present, &scoped); err != nil {
		return "", fmt.Errorf("eventline: check the consumer schema %q: %w", s.schema, err)
	}
	switch {
	case !present:
		return fmt.Sprintf("schema %q has no held_events table; run `eventline migrate up` or migrations.Up on the consumer's database first (check Config.Schema if the tables are in another schema)",
			s.schema), nil
	case !scoped:
		return fmt.Sprintf("schema %q keys processed_events by event id alone (before 007_dedup_scope); run `eventline migrate up` or migrations.Up on the consumer's database first",
			s.schema), nil
	}
	return "", nil
}
