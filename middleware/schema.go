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

// newestConsumerTable is created by the newest migration the consumer
// needs (004_consumer_dead_letters); the migrations run in order, so its
// presence implies every earlier consumer table.
const newestConsumerTable = "consumer_dead_letters"

// CheckMigrated returns an error wrapping [ErrNotMigrated], naming the
// schema and what to run, when schema lacks the consumer tables
// (processed_events, aggregate_versions, parked and late events, dead
// letters); nil when they are there. Without them every event would fail
// on a missing table. consumer.Run calls it before it consumes; call it at
// start-up when you mount the middleware on your own Router.
func CheckMigrated(ctx context.Context, db versioning.DBTX, schema string) error {
	if schema == "" {
		schema = migrations.DefaultSchema
	}
	var present bool
	err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, sqlident.Qualify(schema, newestConsumerTable)).Scan(&present)
	if err != nil {
		return fmt.Errorf("eventline: check the consumer schema %q: %w", schema, err)
	}
	if !present {
		return fmt.Errorf("%w: schema %q has no %s table; run `eventline migrate up` or migrations.Up on the consumer's database first (check Config.Schema if the tables are in another schema)",
			ErrNotMigrated, schema, newestConsumerTable)
	}
	return nil
}
