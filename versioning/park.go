package versioning

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
)

// Parked is one event waiting in parked_events for a missing earlier
// version of its aggregate.
type Parked struct {
	// Group is the consumer group that parked the event.
	Group string
	// AggregateType and AggregateID name the aggregate.
	AggregateType string
	AggregateID   string // see AggregateType
	// Version is the event's aggregate version.
	Version int64
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
	// turn came; LastError and LastAttemptAt describe the last one.
	ReleaseAttempts int
	LastError       string    // see ReleaseAttempts
	LastAttemptAt   time.Time // see ReleaseAttempts

	// expired is set when the row was loaded with a park timeout and has
	// waited longer.
	expired bool
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

// ParkRequest describes an event to park.
type ParkRequest struct {
	// Group is the consumer group parking the event.
	Group string
	// Event is the event to park.
	Event eventline.Event
	// Handler is the Watermill handler name that will release it.
	Handler string
	// Topic is the topic it arrived on, if known.
	Topic string
	// Message is the message as received; its payload and metadata are
	// stored. When nil, the event is re-encoded with eventline.Encode.
	Message *message.Message
}

// Park stores an event that arrived ahead of a missing version, in tx,
// which must hold the aggregate's lock (it does after [Store.Admit]). It
// counts the event in aggregate_versions.parked_count and sets its dedup
// outcome to parked. Parking an event that is already parked with the same
// id is a no-op (already is true); another event already parked under the
// same version yields a *ParkConflictError.
func (s *Store) Park(ctx context.Context, tx DBTX, r ParkRequest) (already bool, err error) {
	e := r.Event
	msg := r.Message
	if msg == nil {
		if msg, err = eventline.Encode(e); err != nil {
			return false, err
		}
	}
	md := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		md[k] = v
	}
	tag, err := tx.Exec(ctx, s.q.park, r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.ID, e.Type,
		r.Handler, r.Topic, []byte(msg.Payload), md)
	if err != nil {
		return false, fmt.Errorf("versioning: park event %s: %w", e.ID, err)
	}
	k := Key{Group: r.Group, AggregateType: e.AggregateType, AggregateID: e.AggregateID}
	if tag.RowsAffected() == 0 {
		var other string
		if err := tx.QueryRow(ctx, s.q.parkedID, k.Group, k.AggregateType, k.AggregateID, e.AggregateVersion).Scan(&other); err != nil {
			return false, fmt.Errorf("versioning: read parked event at %s v%d: %w", k, e.AggregateVersion, err)
		}
		if other == e.ID {
			return true, nil
		}
		return false, &ParkConflictError{AggregateType: e.AggregateType, AggregateID: e.AggregateID, Version: e.AggregateVersion, EventID: e.ID, ParkedEventID: other}
	}
	if _, err := tx.Exec(ctx, s.q.addParked, k.Group, k.AggregateType, k.AggregateID, 1); err != nil {
		return false, fmt.Errorf("versioning: count parked event of %s: %w", k, err)
	}
	if err := s.dedup.SetOutcome(ctx, tx, r.Group, e.ID, dedup.OutcomeParked); err != nil {
		return false, err
	}
	return false, nil
}

// ParkedFilter selects parked events for [Store.ListParked]. Empty fields
// match everything.
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
	rows, err := db.Query(ctx, s.q.listParked, f.Group, f.AggregateType, f.AggregateID, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("versioning: list parked events: %w", err)
	}
	return collectParked(rows)
}

// parkedOf loads an aggregate's parked events in version order, marking
// those parked longer than timeout ago.
func (s *Store) parkedOf(ctx context.Context, tx DBTX, k Key, timeout time.Duration, limit int) ([]Parked, error) {
	rows, err := tx.Query(ctx, s.q.parkedOf, k.Group, k.AggregateType, k.AggregateID, timeout.Microseconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("versioning: load parked events of %s: %w", k, err)
	}
	return collectParked(rows)
}

func collectParked(rows pgx.Rows) ([]Parked, error) {
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Parked, error) {
		var p Parked
		var last *time.Time
		err := r.Scan(&p.Group, &p.AggregateType, &p.AggregateID, &p.Version, &p.EventID, &p.EventType, &p.Handler, &p.Topic,
			&p.Payload, &p.Metadata, &p.ParkedAt, &p.ReleaseAttempts, &p.LastError, &last, &p.expired)
		if last != nil {
			p.LastAttemptAt = *last
		}
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("versioning: read parked events: %w", err)
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

// SkippedFilter selects rows for [Store.ListSkipped]. Empty fields match
// everything.
type SkippedFilter struct {
	// Group, AggregateType and AggregateID select exact values.
	Group         string
	AggregateType string // see Group
	AggregateID   string // see Group
	// Limit caps the result. Defaults to 100.
	Limit int
}

// ListSkipped returns audited gaps in the order they were recorded.
func (s *Store) ListSkipped(ctx context.Context, db DBTX, f SkippedFilter) ([]Skipped, error) {
	if f.Limit <= 0 {
		f.Limit = DefaultListLimit
	}
	rows, err := db.Query(ctx, s.q.listSkipped, f.Group, f.AggregateType, f.AggregateID, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("versioning: list skipped versions: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Skipped, error) {
		var x Skipped
		err := r.Scan(&x.ID, &x.Group, &x.AggregateType, &x.AggregateID, &x.From, &x.To, &x.Reason, &x.SkippedAt)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("versioning: read skipped versions: %w", err)
	}
	return out, nil
}

// CountParked returns how many events the group has parked.
func (s *Store) CountParked(ctx context.Context, db DBTX, group string) (int64, error) {
	var n int64
	if err := db.QueryRow(ctx, s.q.countParked, group).Scan(&n); err != nil {
		return 0, fmt.Errorf("versioning: count parked events of %q: %w", group, err)
	}
	return n, nil
}
