package producer

import (
	"errors"
	"fmt"

	"github.com/eventline/eventline/internal/outbox"
)

// Errors a caller matches with errors.Is. The typed errors
// (VersionConflictError and the others) match theirs; every error says what
// to do about it.
var (
	// ErrVersionConflict is matched by *VersionConflictError.
	ErrVersionConflict = errors.New("eventline: aggregate version conflict")

	// ErrVersionGap is matched by *VersionGapError.
	ErrVersionGap = errors.New("eventline: aggregate version gap")

	// ErrTopicConflict is matched by *TopicConflictError.
	ErrTopicConflict = errors.New("eventline: aggregate published to a second topic")

	// ErrSchemaVersion is matched by *SchemaVersionError.
	ErrSchemaVersion = errors.New("eventline: payload schema version not declared")

	// ErrEventTooLarge is matched by *EventTooLargeError.
	ErrEventTooLarge = errors.New("eventline: event too large for Kafka")

	// ErrNotMigrated is returned by New and NewRelay when the schema has no
	// outbox (or, for a relay, lacks a later migration's tables).
	ErrNotMigrated = outbox.ErrNotMigrated

	// ErrPoolTooSmall is returned by NewRelay when the pool cannot hold the
	// connections a relay needs; the error says how many.
	ErrPoolTooSmall = errors.New("eventline: the relay's pool is too small")

	// ErrRelayRunning is returned by a second call to Relay.Run, whether the
	// first is still running or has returned.
	ErrRelayRunning = errors.New("eventline: relay was already started; a Relay runs once (create a new one to run again)")

	// ErrSessionPooling is returned by Relay.Run when its connections go
	// through a pooler that hands out server connections per transaction or
	// statement (PgBouncer's pool_mode = transaction or statement): LISTEN
	// and session settings do not survive there. Connect relays to PostgreSQL
	// directly or through a session-mode pool; producers and consumers need
	// no session and work through any pooler.
	ErrSessionPooling = errors.New("eventline: the relay's connections go through a transaction- or statement-mode pooler; relays need session-level connections: connect them directly to PostgreSQL or through a pool in session mode (PgBouncer pool_mode = session)")
)

// VersionConflictError reports a supplied aggregate version that is not
// above the aggregate's last published version (counting the events before
// it in the same call): another writer published that version first, or
// the caller's copy of the aggregate is stale. Nothing of the call was
// written; the transaction that got it is still usable.
type VersionConflictError struct {
	AggregateType string
	AggregateID   string
	// Version is the version the caller supplied.
	Version int64
	// Current is the aggregate's last published version.
	Current int64
	// Next is the version the supplied one had to be: Current+1, plus the
	// number of events of the aggregate without a version that come
	// before it in the same call.
	Next int64
}

func (e *VersionConflictError) Error() string {
	if e.Next == e.Current+1 {
		return fmt.Sprintf("eventline: aggregate %s/%s: version %d is not greater than the last published version %d; reload the aggregate and retry",
			e.AggregateType, e.AggregateID, e.Version, e.Current)
	}
	return fmt.Sprintf("eventline: aggregate %s/%s: version %d is below %d, the version after the last published version %d and the %d event(s) without a version before it in this call; reload the aggregate and retry",
		e.AggregateType, e.AggregateID, e.Version, e.Next, e.Current, e.Next-e.Current-1)
}

// Unwrap lets errors.Is(err, ErrVersionConflict) match.
func (e *VersionConflictError) Unwrap() error { return ErrVersionConflict }

// VersionGapError reports a supplied aggregate version that skips versions
// while the producer does not allow gaps (Config.AllowVersionGaps): without
// it, every consumer would wait for versions that never come. Nothing of the
// call was written; the transaction is still usable.
type VersionGapError struct {
	AggregateType string
	AggregateID   string
	// Version is the version the caller supplied.
	Version int64
	// Next is the version the aggregate's next event must have: the last
	// published version plus one, or the version after the event before it
	// in the same call.
	Next int64
}

func (e *VersionGapError) Error() string {
	return fmt.Sprintf("eventline: aggregate %s/%s: version %d would skip versions %d..%d; supply %d, leave AggregateVersion 0 to have the next version assigned, "+
		"or set producer.Config.AllowVersionGaps if the versions are sparse by design",
		e.AggregateType, e.AggregateID, e.Version, e.Next, e.Version-1, e.Next)
}

// Unwrap lets errors.Is(err, ErrVersionGap) match.
func (e *VersionGapError) Unwrap() error { return ErrVersionGap }

// TopicConflictError reports an event for a topic other than the one its
// aggregate's events go to. One aggregate, one topic: a consumer group
// reading a topic must see every version of the aggregates on it, or it
// would wait for versions that went elsewhere. Nothing of the call was
// written; the transaction is still usable.
type TopicConflictError struct {
	AggregateType string
	AggregateID   string
	// Topic is the topic the aggregate's events go to: recorded when its
	// first event was published, or given by an earlier event in the same
	// call.
	Topic string
	// Requested is the topic of the refused event.
	Requested string
}

func (e *TopicConflictError) Error() string {
	return fmt.Sprintf("eventline: aggregate %s/%s publishes to topic %q, refusing an event for topic %q: all events of one aggregate go to one topic, "+
		"so that consumers see all of its versions; publish it to %q, or give the other stream its own aggregate type or id",
		e.AggregateType, e.AggregateID, e.Topic, e.Requested, e.Topic)
}

// Unwrap lets errors.Is(err, ErrTopicConflict) match.
func (e *TopicConflictError) Unwrap() error { return ErrTopicConflict }

// SchemaVersionError reports an event whose SchemaVersion is above the
// version the producer declares for its type (Config.SchemaVersions): a
// payload shape this service does not know it writes.
type SchemaVersionError struct {
	Index     int
	EventType string
	// Version is the event's SchemaVersion.
	Version int
	// Declared is Config.SchemaVersions[EventType].
	Declared int
}

func (e *SchemaVersionError) Error() string {
	return fmt.Sprintf("eventline: event %d of type %q has payload schema version %d, above the declared current version %d "+
		"(producer.Config.SchemaVersions); raise the declared version when the new payload shape ships, or leave SchemaVersion 0 to get the declared one",
		e.Index, e.EventType, e.Version, e.Declared)
}

// Unwrap lets errors.Is(err, ErrSchemaVersion) match.
func (e *SchemaVersionError) Unwrap() error { return ErrSchemaVersion }

// EventTooLargeError reports an event whose Kafka record would exceed the
// configured maximum. PublishTx returns it before any SQL runs, so the
// caller's transaction stays usable.
type EventTooLargeError struct {
	// Index is the event's position in the PublishTx call.
	Index         int
	EventID       string
	AggregateType string
	AggregateID   string
	// Size is the record size Sarama would compute (for an event whose
	// version is assigned by the outbox, with room for the largest
	// version), in bytes.
	Size int
	// Limit is producer.Config.MaxMessageBytes.
	Limit int
}

func (e *EventTooLargeError) Error() string {
	return fmt.Sprintf("eventline: event %d (id %s, aggregate %s/%s) would be a %d-byte Kafka record, over the %d-byte limit "+
		"(producer.Config.MaxMessageBytes); store large bodies elsewhere and publish a reference to them, or raise the limit "+
		"together with the relay's RelayConfig.MaxMessageBytes and the topic's max.message.bytes",
		e.Index, e.EventID, e.AggregateType, e.AggregateID, e.Size, e.Limit)
}

// Unwrap lets errors.Is(err, ErrEventTooLarge) match.
func (e *EventTooLargeError) Unwrap() error { return ErrEventTooLarge }
