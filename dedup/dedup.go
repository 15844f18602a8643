package dedup

import "time"

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

// Record is what a consumer group recorded of an event in
// processed_events, as `eventline` commands show it and as an
// IDConflictError names the two events sharing an id.
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

// Causes of consumer dead letters (the cause of a held event of kind
// dead_letter, and the reason label of
// eventline_consumer_events_dead_lettered_total). Components that
// dead-letter for their own reasons add their own, through an error with
// a DeadLetterKind() string method.
const (
	// KindPermanent: the event can never succeed (it does not decode, no
	// handler knows its type, the handler marked its error permanent…).
	KindPermanent = "permanent"
	// KindRetriesExhausted: the handler kept failing until the retry
	// budget was spent.
	KindRetriesExhausted = "retries_exhausted"
	// KindFailed: the handler failed and no retry middleware ran.
	KindFailed = "failed"
	// KindIDConflict: the event reused the id of a different event the
	// group already recorded (see IDConflictError).
	KindIDConflict = "id_conflict"
)

// Retention of processed_events (`eventline cleanup`).
const (
	// DefaultRetention keeps dedup rows for a week: longer than Kafka's
	// default topic retention (7 days) would be safer still; see the
	// package documentation.
	DefaultRetention = 7 * 24 * time.Hour
	// MinRetention is the shortest retention a cleanup accepts; anything
	// shorter is almost certainly a unit mistake and would make recent
	// redeliveries look new.
	MinRetention = time.Minute
)
