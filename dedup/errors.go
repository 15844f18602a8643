package dedup

import (
	"errors"
	"fmt"
)

// ErrIDConflict is matched by *IDConflictError.
var ErrIDConflict = errors.New("eventline: two different events share one event id")

// IDConflictError reports a dedup hit whose recorded row belongs to a
// different event of the same aggregate: another event type or aggregate
// version carrying the same event id. Dedup cannot tell which of the two
// is genuine, so the event is refused (the middleware dead-letters it with
// this error as the reason) instead of being skipped as a duplicate.
// Retrying cannot help. (Events of different aggregates never conflict:
// the id is recorded per aggregate, so an id reused in another aggregate
// is another event and costs the genuine one nothing.)
type IDConflictError struct {
	// Group is the consumer group.
	Group string
	// EventID is the shared id.
	EventID string
	// Event is the identity of the refused event; Recorded the identity
	// already recorded under the id. Only EventType, AggregateType,
	// AggregateID and AggregateVersion are set.
	Event    Record
	Recorded Record // see Event
}

// Error implements error; the message names both events and says what to do.
func (e *IDConflictError) Error() string {
	return fmt.Sprintf("eventline: event id %s conflict in consumer group %q: this event is %s, but the id is already recorded for %s; "+
		"a producer reused an event id (every event needs its own). The event was not applied. Find which of the two is genuine "+
		"(processed_events holds the recorded one); republish a genuine event under a new id",
		e.EventID, e.Group, describe(e.Event), describe(e.Recorded))
}

// Unwrap lets errors.Is(err, ErrIDConflict) match.
func (e *IDConflictError) Unwrap() error { return ErrIDConflict }

func describe(r Record) string {
	if r.AggregateVersion == 0 {
		return fmt.Sprintf("%s of %s/%s (unversioned)", r.EventType, r.AggregateType, r.AggregateID)
	}
	return fmt.Sprintf("%s of %s/%s v%d", r.EventType, r.AggregateType, r.AggregateID, r.AggregateVersion)
}

// DeadLetterKind files the refused event's dead letter under
// KindIDConflict.
func (e *IDConflictError) DeadLetterKind() string { return KindIDConflict }
