package versioning

import (
	"errors"
	"fmt"
)

// ErrGapTooLarge is matched by *GapTooLargeError.
var ErrGapTooLarge = errors.New("eventline: the event would leave too many aggregate versions missing")

// GapTooLargeError refuses an event that follows v-1 (it declares no
// other predecessor) and would leave more than MaxGap versions missing in
// front of it: most likely its version is inflated (a bad producer, a
// hand-made record). Parking it would, after the park
// timeout, skip every genuine version in between. Retrying cannot help:
// the middleware dead-letters it with this error as the reason.
type GapTooLargeError struct {
	// AggregateType and AggregateID name the aggregate.
	AggregateType string
	AggregateID   string // see AggregateType
	// EventID is the refused event; Version and Previous its aggregate
	// version and the version it says it follows.
	EventID  string
	Version  int64 // see EventID
	Previous int64 // see EventID
	// Known is the highest version the aggregate has applied or parked
	// below Previous; versions Known+1..Previous would be missing.
	Known int64
	// MaxGap is the configured bound.
	MaxGap int64
}

// Error implements error; the message says what to check and what to do.
func (e *GapTooLargeError) Error() string {
	return fmt.Sprintf("eventline: aggregate %s/%s: event %s (v%d, follows v%d) would leave versions %d..%d (%d) missing, more than MaxGap %d: "+
		"its version is probably inflated; fix the producer. If the gap is genuine, raise MaxGap and replay the dead letter",
		e.AggregateType, e.AggregateID, e.EventID, e.Version, e.Previous, e.Known+1, e.Previous, e.Previous-e.Known, e.MaxGap)
}

// Unwrap lets errors.Is(err, ErrGapTooLarge) match.
func (e *GapTooLargeError) Unwrap() error { return ErrGapTooLarge }

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

// DeadLetterKind files the refused event under "gap_too_large" in the
// consumer's dead letters.
func (e *GapTooLargeError) DeadLetterKind() string { return "gap_too_large" }
