package versioning

import (
	"errors"
	"fmt"
)

// ErrGap is matched by *GapError.
var ErrGap = errors.New("eventline: aggregate version gap")

// GapError rejects an event that arrived ahead of a missing version under
// the Reject policy. It is not permanent: a retry may find the gap filled.
type GapError struct {
	// AggregateType and AggregateID name the aggregate.
	AggregateType string
	AggregateID   string // see AggregateType
	// Version is the event's aggregate version.
	Version int64
	// Current is the aggregate's last applied version.
	Current int64
}

// Error implements error; the message says which versions are missing.
func (e *GapError) Error() string {
	return fmt.Sprintf("eventline: aggregate %s/%s: version %d arrived but %d is the last applied; versions %d..%d are missing (gap policy reject): the event is retried and then dead-lettered unless they arrive",
		e.AggregateType, e.AggregateID, e.Version, e.Current, e.Current+1, e.Version-1)
}

// Unwrap lets errors.Is(err, ErrGap) match.
func (e *GapError) Unwrap() error { return ErrGap }

// ErrUnversioned rejects an event without an aggregate version under
// RejectUnversioned. Retrying cannot help.
var ErrUnversioned = errors.New("eventline: event has no aggregate_version and the consumer rejects unversioned events; publish it with a version or configure the consumer to pass unversioned events")

// ErrParkConflict is matched by *ParkConflictError.
var ErrParkConflict = errors.New("eventline: two events claim the same aggregate version")

// ParkConflictError reports an event that would be parked under a version
// another, different event is already parked with. The producer assigned
// one version twice; retrying cannot help.
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

// ErrNothingParked is returned by ReleaseGap when the aggregate has no
// parked events, so there is no gap to release.
var ErrNothingParked = errors.New("eventline: the aggregate has no parked events")

// ErrNoHandler is returned (and recorded as a parked event's last error)
// when no handler is known for a parked event.
var ErrNoHandler = errors.New("eventline: no handler registered for the parked event")
