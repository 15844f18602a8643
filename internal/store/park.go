package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/versioning"
)

// parkedCols are the columns collectParked scans, followed by the expired
// and due flags.
const parkedCols = `consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type, handler, topic,
	payload, metadata, parked_at, release_attempts, coalesce(last_error, ''), last_attempt_at, next_attempt_at`

var (
	// Park in one statement ($1 group, $2 type, $3 id, $4 version, $5
	// previous version, $6 event id, $7 event type, $8 handler, $9
	// topic, $10 payload, $11 metadata, $12 current version, $13 max
	// gap): known is the highest version applied or parked below the
	// event's predecessor; the event is parked only when it leaves at
	// most $13 versions missing. The count and the dedup outcome
	// follow the insert. The last column names the event already
	// parked under the version, if any (read from the statement's
	// snapshot, which the aggregate's lock keeps current).
	parkSQL = statement(`WITH known AS (
			SELECT greatest($12::bigint, coalesce(max(aggregate_version), 0)) AS v FROM {schema}.parked_events
			WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version <= $5::bigint
		), ins AS (
			INSERT INTO {schema}.parked_events (consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version,
				event_id, event_type, handler, topic, payload, metadata)
			SELECT $1, $2, $3, $4::bigint, $5::bigint, $6, $7, $8, $9, $10, $11 FROM known WHERE $5::bigint - known.v <= $13::bigint
			ON CONFLICT DO NOTHING RETURNING 1
		), counted AS (
			UPDATE {schema}.aggregate_versions SET parked_count = parked_count + 1
			WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND EXISTS (SELECT 1 FROM ins)
		), outcome AS (
			UPDATE {schema}.processed_events SET outcome = 'parked'
			WHERE consumer_group = $1 AND event_id = $6 AND aggregate_type = $2 AND aggregate_id = $3 AND EXISTS (SELECT 1 FROM ins)
		)
		SELECT EXISTS (SELECT 1 FROM ins), (SELECT v FROM known),
			(SELECT event_id FROM {schema}.parked_events WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4::bigint)`)
	parkedOfSQL = statement(`SELECT ` + parkedCols + `, (parked_at <= now() - $4::bigint * interval '1 microsecond'),
			(next_attempt_at IS NULL OR next_attempt_at <= now())
		FROM {schema}.parked_events WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
		ORDER BY aggregate_version LIMIT $5`)
	listParkedSQL = statement(`SELECT ` + parkedCols + `, false, false FROM {schema}.parked_events
		WHERE ($1 = '' OR consumer_group = $1) AND ($2 = '' OR aggregate_type = $2) AND ($3 = '' OR aggregate_id = $3)
		ORDER BY consumer_group, aggregate_type, aggregate_id, aggregate_version LIMIT $4`)
	countParkedSQL = statement(`SELECT count(*) FROM {schema}.parked_events WHERE consumer_group = $1`)
	listSkippedSQL = statement(`SELECT id, consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason, skipped_at FROM {schema}.skipped_versions
		WHERE ($1 = '' OR consumer_group = $1) AND ($2 = '' OR aggregate_type = $2) AND ($3 = '' OR aggregate_id = $3)
		ORDER BY id LIMIT $4`)
)

// Parked is one event waiting in parked_events for a missing earlier
// version of its aggregate.
type Parked struct {
	// Group is the consumer group that parked the event.
	Group string
	// AggregateType and AggregateID name the aggregate.
	AggregateType string
	AggregateID   string // see AggregateType
	// Version is the event's aggregate version; PreviousVersion the
	// version it follows. It is applied once the aggregate is at
	// PreviousVersion or past it (and below Version).
	Version         int64
	PreviousVersion int64 // see Version
	// EventID and EventType identify the event.
	EventID   string
	EventType string // see EventID
	// Handler is the Watermill handler name the event arrived on; the
	// sweeper releases it through that handler.
	Handler string
	// Topic is the topic the event arrived on, when known.
	Topic string
	// Payload and Metadata are the message as received, so a release hands
	// the handler exactly what it would have seen.
	Payload  []byte
	Metadata map[string]string // see Payload
	// ParkedAt is when the event was parked.
	ParkedAt time.Time
	// ReleaseAttempts counts failed attempts to apply the event once its
	// turn came; LastError and LastAttemptAt describe the last one, and
	// NextAttemptAt is when the sweeper may try again (zero: at once).
	ReleaseAttempts int
	LastError       string    // see ReleaseAttempts
	LastAttemptAt   time.Time // see ReleaseAttempts
	NextAttemptAt   time.Time // see ReleaseAttempts
	// Late is true for a late event (held_events): its version was given
	// up on and later versions have been applied; the handler is told
	// (middleware.IsLate).
	Late bool

	// expired is set when the row was loaded with a park timeout and has
	// waited longer; due when it may be attempted now.
	expired, due bool
}

// Key returns the parked event's aggregate key.
func (p Parked) Key() Key {
	return Key{Group: p.Group, AggregateType: p.AggregateType, AggregateID: p.AggregateID}
}

// Message rebuilds the Watermill message the event arrived as.
func (p Parked) Message() *message.Message {
	msg := message.NewMessage(p.EventID, p.Payload)
	for k, v := range p.Metadata {
		msg.Metadata.Set(k, v)
	}
	return msg
}

// Event decodes the parked message into an event.
func (p Parked) Event() (eventline.Event, error) {
	e, err := eventline.Decode(p.Message())
	if err != nil {
		return eventline.Event{}, err
	}
	e.Topic = p.Topic
	return e, nil
}

// describe names the event for logs and audit reasons.
func (p Parked) describe() string {
	return fmt.Sprintf("event %s (%s v%d)", p.EventID, p.EventType, p.Version)
}

// ParkRequest describes an event the gate keeps without applying it: one
// to park ([Store.Park]), or a stale one ([Store.HoldLate],
// [Store.HoldConflict], which take it as a LateRequest).
type ParkRequest struct {
	// Group is the consumer group.
	Group string
	// Event is the event.
	Event eventline.Event
	// Handler is the Watermill handler name it arrived on, which will
	// release or replay it.
	Handler string
	// Topic is the topic it arrived on, if known.
	Topic string
	// Message is the message as received; its payload and metadata are
	// stored byte-exact. When nil, the event is re-encoded with
	// eventline.Encode.
	Message *message.Message
	// Current is the aggregate's current version (Admission.Previous).
	Current int64
	// MaxGap (Park) bounds the versions the event may leave missing in
	// front of it (see versioning.DefaultMaxGap), unless it declares its
	// predecessor (see Admission.Declared).
	MaxGap int64
	// Hold (HoldLate) holds the event (held_events, kind late) when it is
	// late; false only checks and records the outcome late_applied, for a
	// caller that applies the event now.
	Hold bool
}

// LateRequest is the ParkRequest of a stale event.
type LateRequest = ParkRequest

// Park stores an event that arrived ahead of a missing version, in tx,
// which must hold the aggregate's lock (it does after [Store.Admit]), in
// one statement. It counts the event in aggregate_versions.parked_count and
// sets its dedup outcome to parked.
//
// It refuses, writing nothing:
//   - with a *versioning.GapTooLargeError, an event that does not declare its
//     predecessor (see Admission.Declared) and would leave more than
//     MaxGap versions missing: its previous version minus the highest
//     version the aggregate has applied or parked below it;
//   - with an *eventline.InvalidEventError, an event whose metadata
//     cannot be stored byte-exact (invalid UTF-8, NUL bytes; eventline.Decode
//     already refuses those in every field it reads) or that PostgreSQL
//     refuses for its content;
//   - with a *ParkConflictError, an event whose version another event is
//     already parked with.
//
// All three are permanent: retrying cannot help. Parking an event that is
// already parked with the same id is a no-op (already is true).
func (s *Store) Park(ctx context.Context, tx DBTX, r ParkRequest) (already bool, err error) {
	e, payload, md, err := r.stored()
	if err != nil {
		return false, err
	}
	maxGap := r.MaxGap
	if e.PreviousVersion < e.AggregateVersion-1 {
		maxGap = math.MaxInt64 // it declares its predecessor (see Admission.Declared)
	}
	var inserted bool
	var known int64
	var other *string
	err = tx.QueryRow(ctx, s.q(parkSQL), r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, e.ID, e.Type,
		r.Handler, r.Topic, payload, md, r.Current, maxGap).Scan(&inserted, &known, &other)
	if err != nil {
		return false, contentError(fmt.Errorf("eventline: park event %s: %w", e.ID, err))
	}
	switch {
	case inserted:
		return false, nil
	case e.PreviousVersion-known > maxGap:
		return false, &versioning.GapTooLargeError{AggregateType: e.AggregateType, AggregateID: e.AggregateID, EventID: e.ID,
			Version: e.AggregateVersion, Previous: e.PreviousVersion, Known: known, MaxGap: maxGap}
	case other != nil && *other == e.ID:
		return true, nil
	case other != nil:
		return false, &ParkConflictError{AggregateType: e.AggregateType, AggregateID: e.AggregateID, Version: e.AggregateVersion, EventID: e.ID, ParkedEventID: *other}
	}
	return false, fmt.Errorf("eventline: park event %s: nothing was parked and nothing conflicts", e.ID)
}

// ErrParkConflict is matched by *ParkConflictError.
var ErrParkConflict = errors.New("eventline: two events claim the same aggregate version")

// ParkConflictError reports an event that would be parked under a version
// another, different event is already parked with. The producer assigned
// one version twice; retrying cannot help (the middleware treats it as
// permanent).
type ParkConflictError struct {
	// AggregateType and AggregateID name the aggregate.
	AggregateType string
	AggregateID   string // see AggregateType
	// Version is the version both events claim.
	Version int64
	// EventID is the event being parked; ParkedEventID the one already
	// parked.
	EventID       string
	ParkedEventID string // see EventID
}

// Error implements error; the message names both events.
func (e *ParkConflictError) Error() string {
	return fmt.Sprintf("eventline: aggregate %s/%s version %d: event %s cannot be parked, event %s is already parked with that version; the producer assigned one version twice",
		e.AggregateType, e.AggregateID, e.Version, e.EventID, e.ParkedEventID)
}

// Unwrap lets errors.Is(err, ErrParkConflict) match.
func (e *ParkConflictError) Unwrap() error { return ErrParkConflict }

// stored returns r's event, with PreviousVersion set to Follows, and the
// payload and metadata to store for it: the message's, byte-exact, or the
// event re-encoded. Metadata must be valid UTF-8 without NUL bytes (jsonb
// would alter or refuse it); a nil payload is stored as an empty one.
func (r ParkRequest) stored() (eventline.Event, []byte, map[string]string, error) {
	e, err := withFollows(r.Event)
	if err != nil {
		return e, nil, nil, err
	}
	msg := r.Message
	if msg == nil {
		if msg, err = eventline.Encode(e); err != nil {
			return e, nil, nil, err
		}
	}
	md := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		switch {
		case !utf8.ValidString(k) || !utf8.ValidString(v):
			return e, nil, nil, &eventline.InvalidEventError{Field: "metadata", Value: strings.ToValidUTF8(k, "?"), Reason: "keys and values must be valid UTF-8 to be stored byte-exact"}
		case strings.IndexByte(k, 0) >= 0 || strings.IndexByte(v, 0) >= 0:
			return e, nil, nil, &eventline.InvalidEventError{Field: "metadata", Value: strings.ReplaceAll(k, "\x00", ""), Reason: "keys and values must not contain NUL bytes"}
		}
		md[k] = v
	}
	payload := []byte(msg.Payload)
	if payload == nil {
		payload = []byte{}
	}
	return e, payload, md, nil
}

// contentError turns PostgreSQL's refusal of a value (SQLSTATE class 22,
// data exception, or 23502, a NULL where none may be) into an
// *eventline.InvalidEventError: the event's content, not the database, is
// at fault, and retrying cannot help. Other errors are returned as they are.
func contentError(err error) error {
	var pg *pgconn.PgError
	if errors.As(err, &pg) && (strings.HasPrefix(pg.Code, "22") || pg.Code == "23502") {
		return &eventline.InvalidEventError{Field: "message", Reason: fmt.Sprintf("PostgreSQL cannot store it (SQLSTATE %s: %s)", pg.Code, pg.Message)}
	}
	return err
}

// ParkedFilter selects parked events for [Store.ListParked] (and skipped
// ranges, as SkippedFilter). Empty fields match everything.
type ParkedFilter struct {
	// Group, AggregateType and AggregateID select exact values.
	Group         string
	AggregateType string // see Group
	AggregateID   string // see Group
	// Limit caps the result. Defaults to 100.
	Limit int
}

// DefaultListLimit is the row limit of ListParked and ListSkipped when the
// filter sets none.
const DefaultListLimit = 100

// ListParked returns parked events ordered by group, aggregate and version.
// It takes no locks (it backs `eventline parked list`).
func (s *Store) ListParked(ctx context.Context, db DBTX, f ParkedFilter) ([]Parked, error) {
	if f.Limit <= 0 {
		f.Limit = DefaultListLimit
	}
	rows, err := db.Query(ctx, s.q(listParkedSQL), f.Group, f.AggregateType, f.AggregateID, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("eventline: list parked events: %w", err)
	}
	return collectParked(rows)
}

// parkedOf loads up to drainLimit of an aggregate's parked events in
// version order, marking those parked longer than timeout ago.
func (s *Store) parkedOf(ctx context.Context, tx DBTX, k Key, timeout time.Duration) ([]Parked, error) {
	rows, err := tx.Query(ctx, s.q(parkedOfSQL), k.Group, k.AggregateType, k.AggregateID, timeout.Microseconds(), drainLimit)
	if err != nil {
		return nil, fmt.Errorf("eventline: load parked events of %s: %w", k, err)
	}
	return collectParked(rows)
}

func collectParked(rows pgx.Rows) ([]Parked, error) {
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Parked, error) {
		var p Parked
		var last, next *time.Time
		err := r.Scan(&p.Group, &p.AggregateType, &p.AggregateID, &p.Version, &p.PreviousVersion, &p.EventID, &p.EventType, &p.Handler, &p.Topic,
			&p.Payload, &p.Metadata, &p.ParkedAt, &p.ReleaseAttempts, &p.LastError, &last, &next, &p.expired, &p.due)
		if last != nil {
			p.LastAttemptAt = *last
		}
		if next != nil {
			p.NextAttemptAt = *next
		}
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("eventline: read parked events: %w", err)
	}
	return out, nil
}

// Skipped is one audited gap: versions From..To of an aggregate were given
// up on and will never be applied.
type Skipped struct {
	// ID orders the audit rows.
	ID int64
	// Group is the consumer group that gave up on the versions.
	Group string
	// AggregateType and AggregateID name the aggregate.
	AggregateType string
	AggregateID   string // see AggregateType
	// From and To bound the skipped versions, inclusive.
	From, To int64
	// Reason says who gave up and why (park timeout, gap policy apply,
	// operator release).
	Reason string
	// SkippedAt is when.
	SkippedAt time.Time
}

// SkippedFilter selects rows for [Store.ListSkipped] as ParkedFilter
// selects parked events.
type SkippedFilter = ParkedFilter

// ListSkipped returns audited gaps in the order they were recorded.
func (s *Store) ListSkipped(ctx context.Context, db DBTX, f SkippedFilter) ([]Skipped, error) {
	if f.Limit <= 0 {
		f.Limit = DefaultListLimit
	}
	rows, err := db.Query(ctx, s.q(listSkippedSQL), f.Group, f.AggregateType, f.AggregateID, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("eventline: list skipped versions: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Skipped, error) {
		var x Skipped
		err := r.Scan(&x.ID, &x.Group, &x.AggregateType, &x.AggregateID, &x.From, &x.To, &x.Reason, &x.SkippedAt)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("eventline: read skipped versions: %w", err)
	}
	return out, nil
}

// CountParked returns how many events the group has parked.
func (s *Store) CountParked(ctx context.Context, db DBTX, group string) (int64, error) {
	var n int64
	if err := db.QueryRow(ctx, s.q(countParkedSQL), group).Scan(&n); err != nil {
		return 0, fmt.Errorf("eventline: count the parked events of group %q: %w", group, err)
	}
	return n, nil
}
