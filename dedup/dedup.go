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
	// version. Releasing it changes the outcome to applied (or late, when
	// its version was given up on before it could be applied).
	OutcomeParked Outcome = "parked"
	// OutcomeLate: the event's version had been given up on (it is in
	// skipped_versions) before the event could be applied; it is held in
	// held_events (kind late) for an operator, who applies it late or discards it.
	OutcomeLate Outcome = "late"
	// OutcomeLateApplied: a late event was applied after later versions
	// of its aggregate, its handler told so (middleware.IsLate).
	OutcomeLateApplied Outcome = "late_applied"
	// OutcomeLateDiscarded: an operator discarded a late event.
	OutcomeLateDiscarded Outcome = "late_discarded"
)

// Valid reports whether o is one of the recorded outcomes.
func (o Outcome) Valid() bool {
	switch o {
	case OutcomeApplied, OutcomeStale, OutcomeParked, OutcomeLate, OutcomeLateApplied, OutcomeLateDiscarded:
		return true
	}
	return false
}

// Waiting reports whether an event with this outcome is still waiting
// (parked or late): retention keeps its row, so a redelivery stays a
// duplicate while the event itself is held.
func (o Outcome) Waiting() bool { return o == OutcomeParked || o == OutcomeLate }

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

// Key names one processed_events row: a group's record of an event id in
// one aggregate. An event id is recorded per aggregate, so an id another
// aggregate reuses is another event (see the package documentation).
type Key struct {
	// Group is the consumer group, EventID the event's id, AggregateType
	// and AggregateID the aggregate the event names in its envelope.
	Group         string
	EventID       string // see Group
	AggregateType string // see Group
	AggregateID   string // see Group
}

// KeyOf returns the key under which group records e.
func KeyOf(group string, e eventline.Event) Key {
	return Key{Group: group, EventID: e.ID, AggregateType: e.AggregateType, AggregateID: e.AggregateID}
}

// Record is one row of processed_events.
type Record struct {
	// Group is the consumer group that handled the event.
	Group string
	// EventID is the event's id; with the aggregate, the dedup key within
	// the group.
	EventID string
	// EventType and AggregateVersion copy the event's envelope, for
	// operators and to tell a duplicate from an id conflict;
	// AggregateType and AggregateID name its aggregate (part of the key).
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

// Matches reports whether r records the event e: same event type,
// aggregate type, aggregate id and aggregate version. A dedup hit (same
// id, same aggregate) that does not match is an id conflict (see
// [IDConflictError]).
func (r Record) Matches(e eventline.Event) bool {
	return r.EventType == e.Type && r.AggregateType == e.AggregateType &&
		r.AggregateID == e.AggregateID && r.AggregateVersion == e.AggregateVersion
}

// Store reads and writes processed_events in one schema. It holds no
// connections and is safe for concurrent use.
type Store struct {
	schema string
	table  string // qualified

	insertSQL     string
	setOutcomeSQL string
	getSQL        string
	findSQL       string
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
		// The insert, and on a conflict the identity of the row already
		// recorded, in one statement. The recorded row is read from the
		// statement's snapshot, so it is NULL when a concurrent
		// transaction recorded it after the statement began (Insert then
		// reads it again, see [Store.Insert]).
		insertSQL: `WITH ins AS (
				INSERT INTO ` + t + ` (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
				VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING RETURNING 1)
			SELECT EXISTS (SELECT 1 FROM ins), ` + RecordedColumns("r") + `
			FROM (SELECT) AS one LEFT JOIN (SELECT * FROM ` + t + ` WHERE ` + KeyPredicate("", "$1", "$2", "$4", "$5") + `
				AND NOT EXISTS (SELECT 1 FROM ins)) r ON true`,
		setOutcomeSQL: `UPDATE ` + t + ` SET outcome = $5 WHERE ` + KeyPredicate("", "$1", "$2", "$3", "$4"),
		getSQL:        `SELECT ` + recordCols + ` FROM ` + t + ` WHERE ` + KeyPredicate("", "$1", "$2", "$3", "$4"),
		findSQL: `SELECT ` + recordCols + ` FROM ` + t + ` WHERE consumer_group = $1 AND event_id = $2
			ORDER BY aggregate_type, aggregate_id`,
		countSQL: `SELECT count(*) FROM ` + t + ` WHERE consumer_group = $1`,
		// Parked and late rows are never deleted: their event is still
		// waiting, and its redelivery must stay a duplicate.
		cleanupAllSQL: `DELETE FROM ` + t + ` WHERE (consumer_group, event_id, aggregate_type, aggregate_id) IN (
			SELECT consumer_group, event_id, aggregate_type, aggregate_id FROM ` + t + `
			WHERE processed_at < $1 AND outcome NOT IN ('parked', 'late') LIMIT $2)`,
		cleanupSQL: `DELETE FROM ` + t + ` WHERE (consumer_group, event_id, aggregate_type, aggregate_id) IN (
			SELECT consumer_group, event_id, aggregate_type, aggregate_id FROM ` + t + `
			WHERE consumer_group = $3 AND processed_at < $1 AND outcome NOT IN ('parked', 'late') LIMIT $2)`,
	}, nil
}

// recordCols are the columns Get and Find scan.
const recordCols = `consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome, processed_at`

// KeyPredicate returns the SQL condition that selects the processed_events
// row of one key (see [Key]), with alias ("" for none) and the SQL
// expressions of its parts. Every statement that reads or writes one
// event's record uses it, so all of them follow the primary key.
func KeyPredicate(alias, group, eventID, aggregateType, aggregateID string) string {
	if alias != "" {
		alias += "."
	}
	return alias + "consumer_group = " + group + " AND " + alias + "event_id = " + eventID +
		" AND " + alias + "aggregate_type = " + aggregateType + " AND " + alias + "aggregate_id = " + aggregateID
}

// Schema returns the schema the store works in.
func (s *Store) Schema() string { return s.schema }

// Table returns the quoted, schema-qualified name of processed_events.
func (s *Store) Table() string { return s.table }

// Insert records that group handled e with the given outcome, in db's
// transaction. It returns false, and writes nothing, when the group has
// already recorded e.ID in e's aggregate for the same event (same type and
// version): the event is a duplicate. When the recorded row belongs to a
// different event of that aggregate, two events share one id: Insert
// returns an *IDConflictError (matching ErrIDConflict), which retrying
// cannot fix. The id recorded in another aggregate is another event's:
// it neither makes e a duplicate nor conflicts with it. When another
// transaction is inserting the same key concurrently, Insert waits for it
// to end.
//
// The row becomes visible when db's transaction commits and disappears with
// it on rollback, so a failed handler leaves the event unrecorded.
func (s *Store) Insert(ctx context.Context, db DBTX, group string, e eventline.Event, outcome Outcome) (bool, error) {
	args, err := s.insertArgs(group, e, outcome)
	if err != nil {
		return false, err
	}
	var fresh bool
	var rec Recorded
	if err := db.QueryRow(ctx, s.insertSQL, args...).Scan(append([]any{&fresh}, rec.Dest()...)...); err != nil {
		return false, fmt.Errorf("dedup: record event %s: %w", e.ID, err)
	}
	if fresh {
		return true, nil
	}
	return false, s.CheckDuplicate(ctx, db, group, e, rec)
}

// Recorded is the identity of a processed_events row as returned next to
// an insert that conflicted with it; its fields are NULL (nil) when the
// row was not visible to the statement (recorded concurrently).
type Recorded struct {
	EventType        *string
	AggregateType    *string // see EventType
	AggregateID      *string // see EventType
	AggregateVersion *int64  // see EventType
}

// RecordedColumns lists, for a SELECT, the processed_events columns that
// [Recorded.Dest] scans, from the table alias alias.
func RecordedColumns(alias string) string {
	return alias + ".event_type, " + alias + ".aggregate_type, " + alias + ".aggregate_id, " + alias + ".aggregate_version"
}

// Dest returns the scan destinations for RecordedColumns.
func (r *Recorded) Dest() []any {
	return []any{&r.EventType, &r.AggregateType, &r.AggregateID, &r.AggregateVersion}
}

// CheckDuplicate decides whether a dedup hit on e's key (its id in its
// aggregate) is a duplicate of e (nil) or an id conflict
// (*IDConflictError). rec is the recorded row's identity as read next to
// the insert; when it was not visible (nil fields: another transaction
// recorded it concurrently and has committed since), the row is read
// again through db.
func (s *Store) CheckDuplicate(ctx context.Context, db DBTX, group string, e eventline.Event, rec Recorded) error {
	var r Record
	if rec.EventType == nil {
		got, err := s.Get(ctx, db, KeyOf(group, e))
		if err != nil {
			return fmt.Errorf("dedup: read the record of duplicate event %s: %w", e.ID, err)
		}
		r = got
	} else {
		r = Record{Group: group, EventID: e.ID, EventType: *rec.EventType, AggregateType: *rec.AggregateType,
			AggregateID: *rec.AggregateID, AggregateVersion: *rec.AggregateVersion}
	}
	if r.Matches(e) {
		return nil
	}
	return &IDConflictError{Group: group, EventID: e.ID,
		Event:    Record{EventType: e.Type, AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion},
		Recorded: Record{EventType: r.EventType, AggregateType: r.AggregateType, AggregateID: r.AggregateID, AggregateVersion: r.AggregateVersion}}
}

// PendingInsert is an Insert queued on a pgx.Batch by [Store.QueueInsert].
type PendingInsert struct {
	s     *Store
	group string
	e     eventline.Event
	fresh bool
	rec   Recorded
	err   error
	set   bool
}

// Result reports, once the batch's results have been closed, whether the
// event was recorded (false: a duplicate), or an *IDConflictError, as
// Insert does. db is the batch's transaction; it is used only in the rare
// case where the conflicting row was recorded concurrently and must be
// read again.
func (p *PendingInsert) Result(ctx context.Context, db DBTX) (bool, error) {
	switch {
	case p.err != nil:
		return false, p.err
	case !p.set:
		return false, errors.New("dedup: insert result read before the batch results were closed")
	case p.fresh:
		return true, nil
	}
	return false, p.s.CheckDuplicate(ctx, db, p.group, p.e, p.rec)
}

// QueueInsert queues [Store.Insert] on b, so it can travel with the
// transaction's BEGIN (b.BeginTx) in one round trip. The result is
// available from the returned PendingInsert once the batch results are
// closed.
func (s *Store) QueueInsert(b *pgx.Batch, group string, e eventline.Event, outcome Outcome) *PendingInsert {
	p := &PendingInsert{s: s, group: group, e: e}
	args, err := s.insertArgs(group, e, outcome)
	if err != nil {
		p.err = err
		return p
	}
	b.Queue(s.insertSQL, args...).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(append([]any{&p.fresh}, p.rec.Dest()...)...); err != nil {
			p.err = fmt.Errorf("dedup: record event %s: %w", e.ID, err)
			return p.err
		}
		p.set = true
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
func (s *Store) SetOutcome(ctx context.Context, db DBTX, k Key, outcome Outcome) error {
	if !outcome.Valid() {
		return fmt.Errorf("dedup: unknown outcome %q", outcome)
	}
	if _, err := db.Exec(ctx, s.setOutcomeSQL, k.Group, k.EventID, k.AggregateType, k.AggregateID, string(outcome)); err != nil {
		return fmt.Errorf("dedup: set outcome of event %s (%s/%s) to %s: %w", k.EventID, k.AggregateType, k.AggregateID, outcome, err)
	}
	return nil
}

// Get returns the group's record of an event id in an aggregate, or
// ErrNotFound.
func (s *Store) Get(ctx context.Context, db DBTX, k Key) (Record, error) {
	r, err := scanRecord(db.QueryRow(ctx, s.getSQL, k.Group, k.EventID, k.AggregateType, k.AggregateID))
	if errors.Is(err, pgx.ErrNoRows) {
		return Record{}, fmt.Errorf("%w: group %q, event %s of %s/%s", ErrNotFound, k.Group, k.EventID, k.AggregateType, k.AggregateID)
	}
	if err != nil {
		return Record{}, fmt.Errorf("dedup: read event %s: %w", k.EventID, err)
	}
	return r, nil
}

// Find returns every record of an event id in group, ordered by aggregate:
// one, or none; more when records of several aggregates carry the id
// (a producer reused it, see [IDConflictError]).
func (s *Store) Find(ctx context.Context, db DBTX, group, eventID string) ([]Record, error) {
	rows, err := db.Query(ctx, s.findSQL, group, eventID)
	if err != nil {
		return nil, fmt.Errorf("dedup: find event %s: %w", eventID, err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Record, error) { return scanRecord(row) })
	if err != nil {
		return nil, fmt.Errorf("dedup: find event %s: %w", eventID, err)
	}
	return out, nil
}

func scanRecord(row pgx.Row) (Record, error) {
	var r Record
	var outcome string
	err := row.Scan(&r.Group, &r.EventID, &r.EventType, &r.AggregateType, &r.AggregateID, &r.AggregateVersion, &outcome, &r.ProcessedAt)
	r.Outcome = Outcome(outcome)
	return r, err
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
