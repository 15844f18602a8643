package admin

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
	"github.com/eventline/eventline/producer"
)

// CleanupConfig configures Cleanup.
type CleanupConfig struct {
	// Schema is the outbox schema. Defaults to "eventline".
	Schema string
	// Retention is how long rows are kept after they were written.
	// Defaults to producer.DefaultRetentionWindow.
	Retention time.Duration
	// BatchSize bounds the rows one DELETE removes, so cleanup never holds
	// many locks or one long transaction. Defaults to
	// producer.DefaultCleanupBatchSize.
	BatchSize int
	// Pause is the wait between batches, to spread the load. Defaults to 0.
	Pause time.Duration
	// Shards limits cleanup to these shards. Defaults to all.
	Shards []int
}

// CleanupResult reports what Cleanup deleted.
type CleanupResult struct {
	Deleted  int64
	PerShard map[int]int64
}

// Cleanup deletes outbox rows older than the retention window that every
// consumer group of their shard (the relays, and any other watermill-sql
// subscriber of the table) has acknowledged. A shard nobody has read yet
// keeps every row. Rows are deleted oldest first in batches of BatchSize,
// each in its own short transaction. Relays do the same for the shards
// they own every RelayConfig.CleanupInterval.
//
// created_at is written in the producer session's time zone (watermill-sql's
// schema uses TIMESTAMP); run producers and cleanup with the same TimeZone.
func Cleanup(ctx context.Context, db DBTX, cfg CleanupConfig) (CleanupResult, error) {
	if err := checkDB("Cleanup", "db", db); err != nil {
		return CleanupResult{}, err
	}
	cfg.Schema = cmp.Or(cfg.Schema, migrations.DefaultSchema)
	cfg.Retention = cmp.Or(cfg.Retention, producer.DefaultRetentionWindow)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, producer.DefaultCleanupBatchSize)
	if err := sqlident.Validate("admin.CleanupConfig.Schema", cfg.Schema); err != nil {
		return CleanupResult{}, err
	}
	if cfg.Retention < 0 || cfg.BatchSize < 1 || cfg.Pause < 0 {
		return CleanupResult{}, fmt.Errorf("admin.CleanupConfig: Retention and Pause must not be negative and BatchSize must be positive (got %s, %s, %d)", cfg.Retention, cfg.Pause, cfg.BatchSize)
	}
	shards := cfg.Shards
	if shards == nil {
		n, err := outbox.ShardCount(ctx, db, cfg.Schema)
		if err != nil {
			return CleanupResult{}, err
		}
		for s := 0; s < n; s++ {
			shards = append(shards, s)
		}
	}
	perShard, err := outbox.Clean(ctx, db, cfg.Schema, shards, cfg.Retention, cfg.BatchSize, cfg.Pause)
	res := CleanupResult{PerShard: perShard}
	for _, n := range perShard {
		res.Deleted += n
	}
	return res, err
}
