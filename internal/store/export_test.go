package store

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
)

// Schema returns the schema the store works in.
func (s *Store) Schema() string { return s.schema }

// BatchDB is a DBTX that sends batches: *pgxpool.Pool, *pgx.Conn, pgx.Tx.
type BatchDB interface {
	DBTX
	SendBatch(context.Context, *pgx.Batch) pgx.BatchResults
}

// RecordProcessed records that group handled e, through db, as
// QueueRecordProcessed does: false (a duplicate) or a
// *dedup.IDConflictError when e was recorded before.
func (s *Store) RecordProcessed(ctx context.Context, db BatchDB, group string, e eventline.Event, outcome dedup.Outcome) (bool, error) {
	b := &pgx.Batch{}
	p := s.QueueRecordProcessed(b, group, e, outcome)
	if err := db.SendBatch(ctx, b).Close(); err != nil {
		return false, err
	}
	return p.Result(ctx, db)
}

// SetOutcome changes the recorded outcome of an event. It is a no-op when
// the event is not recorded.
func (s *Store) SetOutcome(ctx context.Context, db DBTX, k RecordKey, outcome dedup.Outcome) error {
	_, err := db.Exec(ctx, s.q(setOutcomeSQL), k.Group, k.EventID, k.AggregateType, k.AggregateID, string(outcome))
	return err
}

// RecordKey returns the key of the parked event's processed_events record.
func (p Parked) RecordKey() RecordKey {
	return RecordKey{Group: p.Group, EventID: p.EventID, AggregateType: p.AggregateType, AggregateID: p.AggregateID}
}
