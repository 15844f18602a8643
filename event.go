package eventline

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
)

// Metadata keys carried by every eventline message. They are Watermill
// message metadata on the SQL hop and Kafka record headers on the Kafka hop.
const (
	MetaEventID          = "event_id"
	MetaEventType        = "event_type"
	MetaEventVersion     = "event_version"
	MetaAggregateType    = "aggregate_type"
	MetaAggregateID      = "aggregate_id"
	MetaAggregateVersion = "aggregate_version"
	// MetaPreviousVersion is the aggregate version the event directly
	// follows, written by the producer when it is not aggregate_version-1
	// (a supplied version that deliberately skips numbers). The consumer's
	// gate applies the event once the aggregate is at that version.
	MetaPreviousVersion = "aggregate_previous_version"
	MetaOccurredAt      = "occurred_at"
	MetaCorrelationID   = "correlation_id"
	MetaTraceParent     = "traceparent"
	MetaContentType     = "content_type"
)

// NoPreviousVersion, as Event.PreviousVersion, says that the event follows
// no version of its aggregate although its AggregateVersion is above 1: it
// is the aggregate's first event, numbered from a version the aggregate had
// before it was published (a supplied version, with gaps allowed). On the
// wire it is aggregate_previous_version "0"; it exists because 0 in
// Event.PreviousVersion means "not set".
const NoPreviousVersion int64 = -1

// ContentTypeJSON is the default payload content type. Payloads declared as
// JSON are checked to be valid JSON before they are written.
const ContentTypeJSON = "application/json"

// Limits enforced by [Event.Validate]. They keep identifiers usable as
// database keys and Kafka record keys.
const (
	MaxIdentifierLength = 255
	MaxTopicLength      = 249
)

// reservedMeta lists the metadata keys the envelope owns; Event.Metadata may
// not set them.
var reservedMeta = map[string]bool{
	MetaEventID: true, MetaEventType: true, MetaEventVersion: true,
	MetaAggregateType: true, MetaAggregateID: true, MetaAggregateVersion: true,
	MetaPreviousVersion: true,
	MetaOccurredAt:      true, MetaCorrelationID: true, MetaTraceParent: true,
	MetaContentType: true,
	// Watermill's Kafka marshaler stores the message UUID under this header.
	"_watermill_message_uuid": true,
}

// kafkaTopic is Kafka's own rule for topic names.
var kafkaTopic = regexp.MustCompile(`^[a-zA-Z0-9._-]+$`)

// Event is one domain event: something that happened to one aggregate.
//
// The zero values of ID, SchemaVersion, AggregateVersion, OccurredAt and
// ContentType are filled in when the event is published: a new UUIDv7, 1, the
// next version of the aggregate, the current time and JSON.
type Event struct {
	// ID identifies the event across retries and redeliveries; consumers
	// deduplicate on it. Defaults to a new UUIDv7.
	ID string
	// Type names what happened, e.g. "order.created". Required.
	Type string
	// SchemaVersion is the version of the payload's schema. Defaults to 1.
	SchemaVersion int
	// AggregateType and AggregateID name the entity the event belongs to.
	// Both are required; AggregateID is also the Kafka record key, so all
	// events of one aggregate land in one partition.
	AggregateType string
	AggregateID   string
	// AggregateVersion orders the events of one aggregate: 1, 2, 3... When 0,
	// the producer assigns the next version in the publishing transaction.
	AggregateVersion int64
	// PreviousVersion is the aggregate version this event directly
	// follows. [Decode] always sets it: from the record when the producer
	// wrote it, else AggregateVersion-1 (versions without holes, the
	// normal case). On publish it is set by the producer; [Encode] writes
	// it only when it is not AggregateVersion-1. 0 means "not set" (that
	// is, AggregateVersion-1) on an event built in code; an event that
	// follows no version although its AggregateVersion is above 1 (the
	// first event of an aggregate whose numbering starts higher) says so
	// with [NoPreviousVersion].
	PreviousVersion int64
	// OccurredAt is when the event happened. Defaults to the publish time.
	// Its UTC year must be within 0000 to 9999, the years RFC 3339 (the
	// envelope's format) can write.
	OccurredAt time.Time
	// CorrelationID ties the event to the request or workflow that caused it.
	CorrelationID string
	// TraceParent is a W3C traceparent header, carried through as-is,
	// except that a relay with a TracerProvider writes its own "send" span
	// (a child of this one, in the same trace) into the Kafka record
	// instead, so a consumer sees that span as the event's TraceParent.
	TraceParent string
	// ContentType describes Payload. Defaults to ContentTypeJSON, in which
	// case Payload must be valid JSON.
	ContentType string
	// Payload is the event body.
	Payload []byte
	// Metadata holds extra key/value pairs that travel with the event. Keys
	// must not collide with the Meta* keys above. The W3C trace headers
	// other than traceparent (tracestate, baggage) travel here: the
	// producer adds the caller's when it captures the trace context.
	Metadata map[string]string
	// Topic is the Kafka topic the event is published to. Producers fall
	// back to their configured default topic when it is empty. It is not
	// part of the envelope: a consumer learns it from its subscription.
	Topic string
}

// NewEventID returns a new event id: a UUIDv7, so ids sort by creation time.
func NewEventID() string {
	id, err := uuid.NewV7()
	if err != nil {
		// NewV7 only fails when the system's random source fails.
		return uuid.NewString()
	}
	return id.String()
}

// NewJSONEvent returns an Event of the given type for one aggregate whose
// payload is v encoded as JSON.
func NewJSONEvent(eventType, aggregateType, aggregateID string, v any) (Event, error) {
	payload, err := json.Marshal(v)
	if err != nil {
		return Event{}, &InvalidEventError{Field: "payload", Reason: fmt.Sprintf("cannot encode as JSON: %v", err)}
	}
	return Event{
		Type:          eventType,
		AggregateType: aggregateType,
		AggregateID:   aggregateID,
		Payload:       payload,
	}, nil
}

// DecodePayload decodes the event's JSON payload into a value of type T.
func DecodePayload[T any](e Event) (T, error) {
	var v T
	if err := json.Unmarshal(e.Payload, &v); err != nil {
		return v, &InvalidEventError{Field: "payload", Reason: fmt.Sprintf("cannot decode into %T: %v", v, err)}
	}
	return v, nil
}

// IsJSON reports whether the payload is declared as JSON (the default).
func (e Event) IsJSON() bool {
	ct := e.ContentType
	if ct == "" {
		return true
	}
	if i := strings.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	ct = strings.TrimSpace(strings.ToLower(ct))
	return ct == ContentTypeJSON || strings.HasSuffix(ct, "+json")
}

// Validate checks the event without filling in defaults. It returns an
// *InvalidEventError naming the first field that is wrong.
func (e Event) Validate() error {
	if err := e.checkIdentity(false); err != nil {
		return err
	}
	if e.SchemaVersion < 0 {
		return &InvalidEventError{Field: "event_version", Value: fmt.Sprint(e.SchemaVersion), Reason: "must not be negative"}
	}
	if e.AggregateVersion < 0 {
		return &InvalidEventError{Field: "aggregate_version", Value: fmt.Sprint(e.AggregateVersion), Reason: "must not be negative"}
	}
	switch {
	case e.PreviousVersion == NoPreviousVersion && e.AggregateVersion == 0:
		return &InvalidEventError{Field: MetaPreviousVersion, Value: fmt.Sprint(e.PreviousVersion), Reason: "NoPreviousVersion needs an aggregate version"}
	case e.PreviousVersion < NoPreviousVersion || (e.PreviousVersion > 0 && e.PreviousVersion >= e.AggregateVersion):
		return &InvalidEventError{Field: MetaPreviousVersion, Value: fmt.Sprint(e.PreviousVersion),
			Reason: "must be below aggregate_version and not negative (or NoPreviousVersion)"}
	}
	if !e.OccurredAt.IsZero() {
		// RFC 3339, the envelope's format, has four-digit years: Decode
		// could not read another back, and the consumer would refuse it.
		if y := e.OccurredAt.UTC().Year(); y < 0 || y > 9999 {
			return &InvalidEventError{Field: MetaOccurredAt, Value: e.OccurredAt.String(), Reason: "must be within years 0000 to 9999 (UTC), as RFC 3339 writes them"}
		}
	}
	if err := e.checkOptionalText(); err != nil {
		return err
	}
	if e.Topic != "" {
		if err := ValidateTopic(e.Topic); err != nil {
			return err
		}
	}
	for k, v := range e.Metadata {
		if k == "" || reservedMeta[k] {
			return &InvalidEventError{Field: "metadata", Value: k, Reason: "key is empty or reserved by the envelope"}
		}
		if err := checkMetadataEntry(k, v); err != nil {
			return err
		}
	}
	if e.IsJSON() && !json.Valid(e.Payload) {
		return &InvalidEventError{Field: "payload", Reason: "content type is JSON but the payload is not valid JSON"}
	}
	return nil
}

// ValidateTopic checks a Kafka topic name against Kafka's rules.
func ValidateTopic(topic string) error {
	switch {
	case topic == "":
		return &InvalidEventError{Field: "topic", Reason: "must not be empty"}
	case len(topic) > MaxTopicLength:
		return &InvalidEventError{Field: "topic", Value: topic, Reason: fmt.Sprintf("longer than %d characters", MaxTopicLength)}
	case topic == "." || topic == "..":
		return &InvalidEventError{Field: "topic", Value: topic, Reason: `"." and ".." are not valid topic names`}
	case !kafkaTopic.MatchString(topic):
		return &InvalidEventError{Field: "topic", Value: topic, Reason: "may only contain ASCII letters, digits, '.', '_' and '-'"}
	}
	return nil
}

// checkIdentity checks the event id (required when idRequired), the type
// and the aggregate: present and storable (checkText).
func (e Event) checkIdentity(idRequired bool) error {
	return checkTexts([]textField{
		{MetaEventID, e.ID, idRequired}, {MetaEventType, e.Type, true},
		{MetaAggregateType, e.AggregateType, true}, {MetaAggregateID, e.AggregateID, true},
	})
}

// checkOptionalText checks the correlation id, the traceparent and the
// content type: storable (checkText) when set.
func (e Event) checkOptionalText() error {
	return checkTexts([]textField{
		{MetaCorrelationID, e.CorrelationID, false}, {MetaTraceParent, e.TraceParent, false}, {MetaContentType, e.ContentType, false},
	})
}

// textField is one text field of the envelope, named as on the wire.
type textField struct {
	name, v  string
	required bool
}

// checkTexts checks fields in order: each storable (checkText), and a
// required one not blank.
func checkTexts(fields []textField) error {
	for _, f := range fields {
		if f.required && strings.TrimSpace(f.v) == "" {
			return &InvalidEventError{Field: f.name, Value: f.v, Reason: "must not be empty"}
		}
		if err := checkText(f.name, f.v); err != nil {
			return err
		}
	}
	return nil
}

// checkMetadataEntry rejects a custom metadata pair that cannot travel as a
// Kafka header and be stored byte-exact in PostgreSQL (jsonb): invalid
// UTF-8 or a NUL byte in the key or the value.
func checkMetadataEntry(k, v string) error {
	switch {
	case !utf8.ValidString(k) || !utf8.ValidString(v):
		return &InvalidEventError{Field: "metadata", Value: printable(k), Reason: "keys and values must be valid UTF-8"}
	case strings.IndexByte(k, 0) >= 0 || strings.IndexByte(v, 0) >= 0:
		return &InvalidEventError{Field: "metadata", Value: printable(k), Reason: "keys and values must not contain NUL bytes"}
	}
	return nil
}

// printable returns at most 32 bytes of s, quoted-safe for error messages.
func printable(s string) string {
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "?")
	if len(s) > 32 {
		s = strings.ToValidUTF8(s[:32], "") + "..."
	}
	return s
}

// checkText rejects values that cannot be stored as a PostgreSQL text key or
// a Kafka header: too long, invalid UTF-8, or containing NUL.
func checkText(field, v string) error {
	switch {
	case len(v) > MaxIdentifierLength:
		return &InvalidEventError{Field: field, Value: printable(v), Reason: fmt.Sprintf("longer than %d bytes", MaxIdentifierLength)}
	case !utf8.ValidString(v):
		return &InvalidEventError{Field: field, Reason: "not valid UTF-8"}
	case strings.IndexByte(v, 0) >= 0:
		return &InvalidEventError{Field: field, Reason: "contains a NUL byte"}
	}
	return nil
}
