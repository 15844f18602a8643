package producer

import (
	"context"
	"fmt"
	"time"

	"github.com/eventline/eventline/internal/nilcheck"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// CleanupConfig configures Cleanup.
type CleanupConfig struct {
	// Schema is the outbox schema. Defaults to "eventline".
	Schema string
	// Retention is how long rows are kept after they were written.
	// Defaults to DefaultRetentionWindow.
	Retention time.Duration
	// BatchSize bounds the rows one DELETE removes, so cleanup never holds
	// many locks or one long transaction. Defaults to
	// DefaultCleanupBatchSize.
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
// each in its own short transaction.
//
// created_at is written in the producer session's time zone (watermill-sql's
// schema uses TIMESTAMP); run producers and cleanup with the same TimeZone.
func Cleanup(ctx context.Context, db DBTX, cfg CleanupConfig) (CleanupResult, error) {
	if nilcheck.IsNil(db) {
		return CleanupResult{}, nilDB("Cleanup", "db")
	}
	if cfg.Schema == "" {
		cfg.Schema = migrations.DefaultSchema
	}
	if cfg.Retention == 0 {
		cfg.Retention = DefaultRetentionWindow
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = DefaultCleanupBatchSize
	}
	if err := sqlident.Validate("CleanupConfig.Schema", cfg.Schema); err != nil {
		return CleanupResult{}, err
	}
	if cfg.Retention < 0 || cfg.BatchSize < 1 || cfg.Pause < 0 {
		return CleanupResult{}, fmt.Errorf("CleanupConfig: Retention and Pause must not be negative and BatchSize must be positive (got %s, %s, %d)", cfg.Retention, cfg.Pause, cfg.BatchSize)
	}
	shards := cfg.Shards
	if shards == nil {
		n, err := ReadShardCount(ctx, db, cfg.Schema)
		if err != nil {
			return CleanupResult{}, err
		}
		for s := 0; s < n; s++ {
			shards = append(shards, s)
		}
	}
	res := CleanupResult{PerShard: map[int]int64{}}
	for _, shard := range shards {
		messages := sqlident.Qualify(cfg.Schema, outbox.Table(shard))
		offsets := sqlident.Qualify(cfg.Schema, outbox.OffsetsTable(shard))
		query := `DELETE FROM ` + messages + ` WHERE (transaction_id, "offset") IN (
			SELECT m.transaction_id, m."offset" FROM ` + messages + ` m,
				(SELECT last_processed_transaction_id AS txid, offset_acked AS off FROM ` + offsets + `
				 ORDER BY last_processed_transaction_id, offset_acked LIMIT 1) acked
			WHERE (m.transaction_id, m."offset") <= (acked.txid, acked.off)
			  AND m.created_at < LOCALTIMESTAMP - make_interval(secs => $1)
			ORDER BY m.transaction_id, m."offset"
			LIMIT $2)`
		for {
			tag, err := db.Exec(ctx, query, cfg.Retention.Seconds(), cfg.BatchSize)
			if err != nil {
				return res, fmt.Errorf("clean outbox shard %d: %w", shard, err)
			}
			n := tag.RowsAffected()
			res.Deleted += n
			res.PerShard[shard] += n
			if n < int64(cfg.BatchSize) {
				break
			}
			if cfg.Pause > 0 {
				select {
				case <-ctx.Done():
					return res, ctx.Err()
				case <-time.After(cfg.Pause):
				}
			}
		}
	}
	return res, nil
}
