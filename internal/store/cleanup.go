package store

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/eventline/eventline/dedup"
)

// Defaults for [CleanupConfig] (the retention's are dedup's).
const (
	// DefaultCleanupBatchSize bounds the rows one DELETE removes.
	DefaultCleanupBatchSize = 1000
	// DefaultCleanupPause is the wait between two batches.
	DefaultCleanupPause = 100 * time.Millisecond
)

// CleanupConfig bounds one retention run.
type CleanupConfig struct {
	// Group limits the cleanup to one consumer group. Empty means every
	// group in the schema.
	Group string
	// Retention is how long rows are kept after they were processed. It
	// must exceed the broker's redelivery horizon (see the package
	// documentation). Defaults to dedup.DefaultRetention (7 days); values
	// below dedup.MinRetention are rejected.
	Retention time.Duration
	// BatchSize is the most rows one DELETE statement removes. Defaults to
	// DefaultCleanupBatchSize (1000).
	BatchSize int
	// Pause is the wait after each batch before the next one starts, so
	// Cleanup deletes at most BatchSize rows per Pause. Defaults to
	// DefaultCleanupPause (100ms).
	Pause time.Duration
	// MaxBatches stops the run after this many batches. 0 means no limit:
	// run until no row older than the cutoff is left.
	MaxBatches int
}

func (c CleanupConfig) withDefaults() CleanupConfig {
	c.Retention = cmp.Or(c.Retention, dedup.DefaultRetention)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultCleanupBatchSize)
	c.Pause = cmp.Or(c.Pause, DefaultCleanupPause)
	return c
}

func (c CleanupConfig) validate() error {
	switch {
	case c.Retention < dedup.MinRetention:
		return fmt.Errorf("CleanupConfig.Retention is %s; it must be at least %s and longer than the broker's redelivery horizon", c.Retention, dedup.MinRetention)
	case c.BatchSize < 0:
		return fmt.Errorf("CleanupConfig.BatchSize is %d; it must be positive (0 means %d)", c.BatchSize, DefaultCleanupBatchSize)
	case c.Pause < 0:
		return fmt.Errorf("CleanupConfig.Pause is %s; it must be positive (0 means %s)", c.Pause, DefaultCleanupPause)
	case c.MaxBatches < 0:
		return fmt.Errorf("CleanupConfig.MaxBatches is %d; it must not be negative (0 means no limit)", c.MaxBatches)
	}
	return nil
}

// CleanupResult reports one retention run.
type CleanupResult struct {
	// Deleted is the number of rows removed.
	Deleted int64
	// Batches is the number of DELETE statements run.
	Batches int
	// Cutoff is the processed_at bound: rows processed before it were
	// eligible.
	Cutoff time.Time
}

var (
	// Parked and late rows are never deleted: their event is still
	// waiting, and its redelivery must stay a duplicate.
	cleanupAllSQL = statement(`DELETE FROM {schema}.processed_events
		WHERE (consumer_group, event_id, aggregate_type, aggregate_id) IN (
			SELECT consumer_group, event_id, aggregate_type, aggregate_id FROM {schema}.processed_events
			WHERE processed_at < $1 AND outcome NOT IN ('parked', 'late') LIMIT $2)`)
	cleanupGroupSQL = statement(`DELETE FROM {schema}.processed_events
		WHERE (consumer_group, event_id, aggregate_type, aggregate_id) IN (
			SELECT consumer_group, event_id, aggregate_type, aggregate_id FROM {schema}.processed_events
			WHERE consumer_group = $3 AND processed_at < $1 AND outcome NOT IN ('parked', 'late') LIMIT $2)`)
)

// CleanupProcessed deletes processed_events rows older than cfg.Retention, in
// batches of at most cfg.BatchSize rows, pausing cfg.Pause after every
// batch, until no eligible row is left, cfg.MaxBatches is reached or ctx
// ends. Rows of parked events are never deleted.
//
// Each batch is its own statement, so pass a pool (not a transaction): a
// batch's locks are released when it commits, and an interrupted run keeps
// what it deleted. The cutoff is fixed when the run starts, so a run always
// ends even while new rows keep arriving.
func (s *Store) CleanupProcessed(ctx context.Context, db DBTX, cfg CleanupConfig) (CleanupResult, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return CleanupResult{}, err
	}
	res := CleanupResult{Cutoff: time.Now().Add(-cfg.Retention)}
	for cfg.MaxBatches == 0 || res.Batches < cfg.MaxBatches {
		if res.Batches > 0 {
			t := time.NewTimer(cfg.Pause)
			select {
			case <-ctx.Done():
				t.Stop()
				return res, ctx.Err()
			case <-t.C:
			}
		}
		q, args := s.q(cleanupAllSQL), []any{res.Cutoff, cfg.BatchSize}
		if cfg.Group != "" {
			q, args = s.q(cleanupGroupSQL), append(args, cfg.Group)
		}
		tag, err := db.Exec(ctx, q, args...)
		if err != nil {
			return res, fmt.Errorf("eventline: cleanup batch %d: %w", res.Batches+1, err)
		}
		res.Batches++
		res.Deleted += tag.RowsAffected()
		if tag.RowsAffected() < int64(cfg.BatchSize) {
			break
		}
	}
	return res, nil
}
