package dedup

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// Table is the unqualified name of the dedup table.
const Table = "processed_events"

// Outcome says what a consumer group did with an event.
type Outcome string

// The outcomes recorded in processed_events.outcome.
const (
	// OutcomeApplied: the handler ran and its effects committed with the row.
	OutcomeApplied Outcome = "applied"
	// OutcomeStale: the version gate discarded the event because the
	// aggregate had already reached its version; the handler did not run.
	OutcomeStale Outcome = "stale"
	// OutcomeParked: the event waits in parked_events for a missing earlier
	// version. Releasing it changes the outcome to applied (or stale, when
	// a newer version overtook it).
	OutcomeParked Outcome = "parked"
)

// Valid reports whether o is one of the recorded outcomes.
func (o Outcome) Valid() bool {
	return o == OutcomeApplied || o == OutcomeStale || o == OutcomeParked
}

// ErrNotFound is returned by [Store.Get] when the group has no record of the
// event: it was never handled, or its row was removed by retention.
var ErrNotFound = errors.New("eventline: event not recorded as processed")

// DBTX is the smallest database handle the store needs; *pgxpool.Pool,
// *pgx.Conn and pgx.Tx satisfy it. Pass the handler's pgx.Tx to make a
// write part of that transaction.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Record is one row of processed_events.
type Record struct {
	// Group is the consumer group that handled the event.
	Group string
	// EventID is the event's id, the dedup key within the group.
	EventID string
	// EventType, AggregateType, AggregateID and AggregateVersion copy the
	// event's envelope, for operators.
	EventType        string
	AggregateType    string // see EventType
	AggregateID      string // see EventType
	AggregateVersion int64  // see EventType; 0 for unversioned events
	// Outcome is what the group did with the event.
	Outcome Outcome
	// ProcessedAt is when the event was first handled (parked events keep
	// the time they were parked).
	ProcessedAt time.Time
}

// Store reads and writes processed_events in one schema. It holds no
// connections and is safe for concurrent use.
type Store struct {
	schema string
	table  string // qualified

	insertSQL     string
	setOutcomeSQL string
	getSQL        string
	countSQL      string
	cleanupAllSQL string
	cleanupSQL    string
}

// NewStore returns a Store for the tables in schema ("" means the default,
// "eventline"). It fails when schema is not a plain SQL identifier.
func NewStore(schema string) (*Store, error) {
	if schema == "" {
		schema = migrations.DefaultSchema
	}
	if err := sqlident.Validate("dedup schema", schema); err != nil {
		return nil, err
	}
	t := sqlident.Qualify(schema, Table)
	return &Store{
		schema: schema,
		table:  t,
		insertSQL: `INSERT INTO ` + t + ` (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
			VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING`,
		setOutcomeSQL: `UPDATE ` + t + ` SET outcome = $3 WHERE consumer_group = $1 AND event_id = $2`,
		getSQL: `SELECT consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome, processed_at
			FROM ` + t + ` WHERE consumer_group = $1 AND event_id = $2`,
		countSQL: `SELECT count(*) FROM ` + t + ` WHERE consumer_group = $1`,
		// Parked rows are never deleted: their event is still waiting, and
		// its redelivery must stay a duplicate.
		cleanupAllSQL: `DELETE FROM ` + t + ` WHERE (consumer_group, event_id) IN (
			SELECT consumer_group, event_id FROM ` + t + `
			WHERE processed_at < $1 AND outcome <> 'parked' LIMIT $2)`,
		cleanupSQL: `DELETE FROM ` + t + ` WHERE (consumer_group, event_id) IN (
			SELECT consumer_group, event_id FROM ` + t + `
			WHERE consumer_group = $3 AND processed_at < $1 AND outcome <> 'parked' LIMIT $2)`,
	}, nil
}

// Schema returns the schema the store works in.
func (s *Store) Schema() string { return s.schema }

// Table returns the quoted, schema-qualified name of processed_events.
func (s *Store) Table() string { return s.table }

// Insert records that group handled e with the given outcome, in db's
// transaction. It returns false, and writes nothing, when the group has
// already recorded e.ID: the event is a duplicate. When another transaction
// is inserting the same event id concurrently, Insert waits for it to end.
//
// The row becomes visible when db's transaction commits and disappears with
// it on rollback, so a failed handler leaves the event unrecorded.
func (s *Store) Insert(ctx context.Context, db DBTX, group string, e eventline.Event, outcome Outcome) (bool, error) {
	args, err := s.insertArgs(group, e, outcome)
	if err != nil {
		return false, err
	}
	tag, err := db.Exec(ctx, s.insertSQL, args...)
	if err != nil {
		return false, fmt.Errorf("dedup: record event %s: %w", e.ID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// PendingInsert is an Insert queued on a pgx.Batch by [Store.QueueInsert].
type PendingInsert struct {
	fresh bool
	err   error
	set   bool
}

// Result reports, once the batch's results have been closed, whether the
// event was recorded (false: a duplicate).
func (p *PendingInsert) Result() (bool, error) {
	if !p.set && p.err == nil {
		return false, errors.New("dedup: insert result read before the batch results were closed")
	}
	return p.fresh, p.err
}

// QueueInsert queues [Store.Insert] on b, so it can travel with the
// transaction's BEGIN (b.BeginTx) in one round trip. The result is
// available from the returned PendingInsert once the batch results are
// closed.
func (s *Store) QueueInsert(b *pgx.Batch, group string, e eventline.Event, outcome Outcome) *PendingInsert {
	p := &PendingInsert{}
	args, err := s.insertArgs(group, e, outcome)
	if err != nil {
		p.err = err
		return p
	}
	b.Queue(s.insertSQL, args...).Exec(func(tag pgconn.CommandTag) error {
		p.fresh, p.set = tag.RowsAffected() == 1, true
		return nil
	})
	return p
}

func (s *Store) insertArgs(group string, e eventline.Event, outcome Outcome) ([]any, error) {
	if group == "" {
		return nil, errors.New("dedup: consumer group is empty")
	}
	if e.ID == "" {
		return nil, &eventline.InvalidEventError{Field: eventline.MetaEventID, Reason: "missing; cannot deduplicate"}
	}
	if !outcome.Valid() {
		return nil, fmt.Errorf("dedup: unknown outcome %q", outcome)
	}
	return []any{group, e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, string(outcome)}, nil
}

// SetOutcome changes the recorded outcome of an event. It is a no-op when
// the event is not recorded (for example when the version gate runs without
// dedup).
func (s *Store) SetOutcome(ctx context.Context, db DBTX, group, eventID string, outcome Outcome) error {
	if !outcome.Valid() {
		return fmt.Errorf("dedup: unknown outcome %q", outcome)
	}
	if _, err := db.Exec(ctx, s.setOutcomeSQL, group, eventID, string(outcome)); err != nil {
		return fmt.Errorf("dedup: set outcome of event %s to %s: %w", eventID, outcome, err)
	}
	return nil
}

// Get returns the group's record of an event, or ErrNotFound.
func (s *Store) Get(ctx context.Context, db DBTX, group, eventID string) (Record, error) {
	var r Record
	var outcome string
	err := db.QueryRow(ctx, s.getSQL, group, eventID).Scan(
		&r.Group, &r.EventID, &r.EventType, &r.AggregateType, &r.AggregateID, &r.AggregateVersion, &outcome, &r.ProcessedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return Record{}, fmt.Errorf("%w: group %q, event %s", ErrNotFound, group, eventID)
	}
	if err != nil {
		return Record{}, fmt.Errorf("dedup: read event %s: %w", eventID, err)
	}
	r.Outcome = Outcome(outcome)
	return r, nil
}

// Count returns how many events the group has recorded (the dedup table's
// size for that group).
func (s *Store) Count(ctx context.Context, db DBTX, group string) (int64, error) {
	var n int64
	if err := db.QueryRow(ctx, s.countSQL, group).Scan(&n); err != nil {
		return 0, fmt.Errorf("dedup: count events of group %q: %w", group, err)
	}
	return n, nil
}
