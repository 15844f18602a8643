package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
)

// processed_events: a consumer group's record of each event it handled,
// keyed by the event id within its aggregate (see package dedup).

// ErrNotFound is returned by [Store.Processed] when the group has no
// record of the event: it was never handled, or its row was removed by
// retention.
var ErrNotFound = errors.New("eventline: event not recorded as processed")

// RecordKey names one processed_events row: a group's record of an event
// id in one aggregate. An event id is recorded per aggregate, so an id
// another aggregate reuses is another event.
type RecordKey struct {
	// Group is the consumer group, EventID the event's id, AggregateType
	// and AggregateID the aggregate the event names in its envelope.
	Group         string
	EventID       string // see Group
	AggregateType string // see Group
	AggregateID   string // see Group
}

// RecordKeyOf returns the key under which group records e.
func RecordKeyOf(group string, e eventline.Event) RecordKey {
	return RecordKey{Group: group, EventID: e.ID, AggregateType: e.AggregateType, AggregateID: e.AggregateID}
}

var (
	// insertProcessedSQL records an event, and on a conflict returns the
	// identity of the row already recorded, in one statement. The recorded
	// row is read from the statement's snapshot, so it is NULL when a
	// concurrent transaction recorded it after the statement began
	// (checkDuplicate then reads it again).
	insertProcessedSQL = statement(`WITH ins AS (
			INSERT INTO {schema}.processed_events (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
			VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING RETURNING 1)
		SELECT EXISTS (SELECT 1 FROM ins), r.event_type, r.aggregate_type, r.aggregate_id, r.aggregate_version
		FROM (SELECT) AS one LEFT JOIN (SELECT * FROM {schema}.processed_events
			WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $4 AND aggregate_id = $5
				AND NOT EXISTS (SELECT 1 FROM ins)) r ON true`)
	setOutcomeSQL = statement(`UPDATE {schema}.processed_events SET outcome = $5
		WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $3 AND aggregate_id = $4`)
	getProcessedSQL = statement(`SELECT consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome, processed_at
		FROM {schema}.processed_events WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $3 AND aggregate_id = $4`)
	findProcessedSQL = statement(`SELECT consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome, processed_at
		FROM {schema}.processed_events WHERE consumer_group = $1 AND event_id = $2 ORDER BY aggregate_type, aggregate_id`)
)

// PendingRecord is a dedup record queued on a pgx.Batch by
// [Store.QueueRecordProcessed].
type PendingRecord struct {
	s     *Store
	group string
	e     eventline.Event
	fresh bool
	rec   recorded
	err   error
	set   bool
}

// Result reports, once the batch's results have been closed, whether the
// event was recorded (false: a duplicate), or a *dedup.IDConflictError
// (see QueueRecordProcessed). db is the batch's transaction; it is used
// only in the rare case where the conflicting row was recorded
// concurrently and must be read again.
func (p *PendingRecord) Result(ctx context.Context, db DBTX) (bool, error) {
	switch {
	case p.err != nil:
		return false, p.err
	case !p.set:
		return false, errors.New("eventline: dedup record read before the batch results were closed")
	case p.fresh:
		return true, nil
	}
	return false, p.s.checkDuplicate(ctx, db, p.group, p.e, p.rec)
}

// QueueRecordProcessed queues on b the record that group handled e with
// the given outcome, so it can travel with the transaction's BEGIN
// (b.BeginTx) in one round trip; the result is available from the
// returned PendingRecord once the batch results are closed. Nothing is
// written when the group has already recorded e.ID in e's aggregate for
// the same event (same type and version): the event is a duplicate. When
// the recorded row belongs to a different event of that aggregate, two
// events share one id: a *dedup.IDConflictError (matching
// dedup.ErrIDConflict), which retrying cannot fix. The id recorded in
// another aggregate is another event's: it neither makes e a duplicate
// nor conflicts with it. When another transaction is inserting the same
// key concurrently, the statement waits for it to end.
//
// The row becomes visible when the batch's transaction commits and
// disappears with it on rollback, so a failed handler leaves the event
// unrecorded.
func (s *Store) QueueRecordProcessed(b *pgx.Batch, group string, e eventline.Event, outcome dedup.Outcome) *PendingRecord {
	p := &PendingRecord{s: s, group: group, e: e}
	args := []any{group, e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, string(outcome)}
	b.Queue(s.q(insertProcessedSQL), args...).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(append([]any{&p.fresh}, p.rec.dest()...)...); err != nil {
			p.err = fmt.Errorf("eventline: record event %s: %w", e.ID, err)
			return p.err
		}
		p.set = true
		return nil
	})
	return p
}

// recorded is the identity of a processed_events row as returned next to
// an insert that conflicted with it; its fields are NULL (not Valid) when the
// row was not visible to the statement (recorded concurrently).
type recorded struct {
	eventType, aggregateType, aggregateID pgtype.Text
	aggregateVersion                      pgtype.Int8
}

func (r *recorded) dest() []any {
	return []any{&r.eventType, &r.aggregateType, &r.aggregateID, &r.aggregateVersion}
}

// checkDuplicate decides whether a dedup hit on e's key (its id in its
// aggregate) is a duplicate of e (nil) or an id conflict
// (*dedup.IDConflictError). rec is the recorded row's identity as read
// next to the insert; when it was not visible (another transaction
// recorded it concurrently and has committed since), the row is read again
// through db.
func (s *Store) checkDuplicate(ctx context.Context, db DBTX, group string, e eventline.Event, rec recorded) error {
	var r dedup.Record
	if !rec.eventType.Valid {
		got, err := s.Processed(ctx, db, RecordKeyOf(group, e))
		if err != nil {
			return fmt.Errorf("eventline: read the record of duplicate event %s: %w", e.ID, err)
		}
		r = got
	} else {
		r = dedup.Record{EventType: rec.eventType.String, AggregateType: rec.aggregateType.String,
			AggregateID: rec.aggregateID.String, AggregateVersion: rec.aggregateVersion.Int64}
	}
	if r.EventType == e.Type && r.AggregateType == e.AggregateType && r.AggregateID == e.AggregateID && r.AggregateVersion == e.AggregateVersion {
		return nil
	}
	return &dedup.IDConflictError{Group: group, EventID: e.ID,
		Event:    dedup.Record{EventType: e.Type, AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion},
		Recorded: dedup.Record{EventType: r.EventType, AggregateType: r.AggregateType, AggregateID: r.AggregateID, AggregateVersion: r.AggregateVersion}}
}

// Processed returns the group's record of an event id in an aggregate, or
// ErrNotFound.
func (s *Store) Processed(ctx context.Context, db DBTX, k RecordKey) (dedup.Record, error) {
	r, err := scanRecord(db.QueryRow(ctx, s.q(getProcessedSQL), k.Group, k.EventID, k.AggregateType, k.AggregateID))
	if errors.Is(err, pgx.ErrNoRows) {
		return dedup.Record{}, fmt.Errorf("%w: group %q, event %s of %s/%s", ErrNotFound, k.Group, k.EventID, k.AggregateType, k.AggregateID)
	}
	if err != nil {
		return dedup.Record{}, fmt.Errorf("eventline: read event %s: %w", k.EventID, err)
	}
	return r, nil
}

// FindProcessed returns every record of an event id in group, ordered by
// aggregate: one, or none; more when records of several aggregates carry
// the id (a producer reused it, see dedup.IDConflictError).
func (s *Store) FindProcessed(ctx context.Context, db DBTX, group, eventID string) ([]dedup.Record, error) {
	rows, err := db.Query(ctx, s.q(findProcessedSQL), group, eventID)
	if err != nil {
		return nil, fmt.Errorf("eventline: find event %s: %w", eventID, err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (dedup.Record, error) { return scanRecord(row) })
	if err != nil {
		return nil, fmt.Errorf("eventline: find event %s: %w", eventID, err)
	}
	return out, nil
}

func scanRecord(row pgx.Row) (dedup.Record, error) {
	var r dedup.Record
	var outcome string
	err := row.Scan(&r.Group, &r.EventID, &r.EventType, &r.AggregateType, &r.AggregateID, &r.AggregateVersion, &outcome, &r.ProcessedAt)
	r.Outcome = dedup.Outcome(outcome)
	return r, err
}
