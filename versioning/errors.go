package versioning

import (
	"errors"
	"fmt"
)

// Errors the gate refuses events with, or records.
var (
	// ErrGapTooLarge is matched by *GapTooLargeError.
	ErrGapTooLarge = errors.New("eventline: the event would leave too many aggregate versions missing")
	// ErrUnversioned rejects an event without an aggregate version under
	// RejectUnversioned. Retrying cannot help.
	ErrUnversioned = errors.New("eventline: event has no aggregate_version and the consumer rejects unversioned events; publish it with a version or configure the consumer to pass unversioned events")
	// ErrNoHandler is a parked event's failure (its last error) when no
	// handler is known for it: none was added under the handler name it
	// arrived on.
	ErrNoHandler = errors.New("eventline: no handler registered for the parked event")
)

// GapTooLargeError refuses an event that follows v-1 (it declares no
// other predecessor) and would leave more than MaxGap versions missing in
// front of it: most likely its version is inflated (a bad producer, a
// hand-made record). Parking it would, after the park timeout, skip every
// genuine version in between. Retrying cannot help: the middleware
// dead-letters it with this error as the reason.
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

// DeadLetterKind files the refused event under "gap_too_large" in the
// consumer's dead letters.
func (e *GapTooLargeError) DeadLetterKind() string { return "gap_too_large" }
