package middleware

import (
	"context"
	"errors"
	"fmt"

	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/versioning"
)

// ErrNotMigrated is returned by [CheckMigrated] (and by consumer.Run) when
// the consumer's schema lacks eventline's consumer tables.
var ErrNotMigrated = errors.New("eventline: consumer schema is not migrated")

// newestConsumerTable is created by the newest migration that adds a
// consumer table (003_held_events); the migrations run in order,
// so its presence implies every earlier consumer table.
const newestConsumerTable = "held_events"

// CheckMigrated returns an error wrapping [ErrNotMigrated], naming the
// schema and what to run, when schema lacks the consumer tables
// (processed_events, aggregate_versions, parked and late events, dead
// letters) or their newest shape (007_dedup_scope: dedup records keyed by
// aggregate); nil when they are there. Without them every event would
// fail on a missing table, or be deduplicated by the old key. consumer.Run
// calls it before it consumes; call it at start-up when you mount the
// middleware on your own Router.
func CheckMigrated(ctx context.Context, db versioning.DBTX, schema string) error {
	if schema == "" {
		schema = migrations.DefaultSchema
	}
	var present, scoped bool
	err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL,
		EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
			WHERE i.indrelid = to_regclass($2) AND i.indisprimary AND a.attname = 'aggregate_id')`,
		sqlident.Qualify(schema, newestConsumerTable), sqlident.Qualify(schema, "processed_events")).Scan(&present, &scoped)
	if err != nil {
		return fmt.Errorf("eventline: check the consumer schema %q: %w", schema, err)
	}
	switch {
	case !present:
		return fmt.Errorf("%w: schema %q has no %s table; run `eventline migrate up` or migrations.Up on the consumer's database first (check Config.Schema if the tables are in another schema)",
			ErrNotMigrated, schema, newestConsumerTable)
	case !scoped:
		return fmt.Errorf("%w: schema %q keys processed_events by event id alone (before 007_dedup_scope); run `eventline migrate up` or migrations.Up on the consumer's database first",
			ErrNotMigrated, schema)
	}
	return nil
}
