package eventline

import (
	"maps"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Encode validates e, fills in its defaults (see [Event]) and returns it as a
// Watermill message: UUID and the event_id metadata hold the event id, the
// payload is e.Payload, and the envelope fields travel as metadata.
//
// It is the only way eventline turns events into messages; Decode is its
// inverse.
func Encode(e Event) (*message.Message, error) {
	if err := e.Validate(); err != nil {
		return nil, err
	}
	e = e.WithDefaults(time.Now())

	md := make(message.Metadata, 8+len(e.Metadata))
	maps.Copy(md, e.Metadata)
	md[MetaEventID] = e.ID
	md[MetaEventType] = e.Type
	md[MetaEventVersion] = strconv.Itoa(e.SchemaVersion)
	md[MetaAggregateType] = e.AggregateType
	md[MetaAggregateID] = e.AggregateID
	if e.AggregateVersion > 0 {
		md[MetaAggregateVersion] = strconv.FormatInt(e.AggregateVersion, 10)
		switch {
		case e.PreviousVersion == NoPreviousVersion && e.AggregateVersion > 1:
			md[MetaPreviousVersion] = "0"
		case e.PreviousVersion > 0 && e.PreviousVersion != e.AggregateVersion-1:
			md[MetaPreviousVersion] = strconv.FormatInt(e.PreviousVersion, 10)
		}
	}
	md[MetaOccurredAt] = e.OccurredAt.Format(time.RFC3339Nano)
	if e.CorrelationID != "" {
		md[MetaCorrelationID] = e.CorrelationID
	}
	if e.TraceParent != "" {
		md[MetaTraceParent] = e.TraceParent
	}
	if e.ContentType != "" && e.ContentType != ContentTypeJSON {
		md[MetaContentType] = e.ContentType
	}

	msg := message.NewMessage(e.ID, e.Payload)
	msg.Metadata = md
	return msg, nil
}

// WithDefaults returns e with its zero-valued ID, SchemaVersion and
// OccurredAt filled in. AggregateVersion is left alone: only the outbox can
// assign it.
func (e Event) WithDefaults(now time.Time) Event {
	if e.ID == "" {
		e.ID = NewEventID()
	}
	if e.SchemaVersion == 0 {
		e.SchemaVersion = 1
	}
	if e.OccurredAt.IsZero() {
		e.OccurredAt = now
	}
	e.OccurredAt = e.OccurredAt.UTC()
	return e
}

// Decode reads an event back from a Watermill message produced by [Encode],
// on either side of Kafka. It returns an *InvalidEventError (matching
// ErrInvalidEvent) when the event id, type or aggregate is missing, when a
// version or timestamp is malformed, or when any field a consumer stores
// (identifiers, correlation id, traceparent, content type, custom
// metadata) is too long, not valid UTF-8 or holds a NUL byte: such a record
// can never be stored as it is, so retrying it cannot help. It never panics
// on bad input. A nil payload decodes as an empty one.
//
// PreviousVersion is taken from the record when present (it must be below
// the aggregate version; 0 there, for a version above 1, decodes as
// [NoPreviousVersion]), else it is AggregateVersion-1.
//
// The topic is taken from the message context when a Watermill Router
// delivered it.
func Decode(msg *message.Message) (Event, error) {
	if msg == nil {
		return Event{}, &InvalidEventError{Field: MetaEventID, Reason: "message is nil"}
	}
	md := msg.Metadata
	e := Event{
		ID:            md.Get(MetaEventID),
		Type:          md.Get(MetaEventType),
		AggregateType: md.Get(MetaAggregateType),
		AggregateID:   md.Get(MetaAggregateID),
		CorrelationID: md.Get(MetaCorrelationID),
		TraceParent:   md.Get(MetaTraceParent),
		ContentType:   md.Get(MetaContentType),
		Payload:       msg.Payload,
	}
	if e.Payload == nil {
		e.Payload = []byte{}
	}
	if e.ID == "" {
		return Event{}, &InvalidEventError{Field: MetaEventID, Reason: "missing from the message metadata"}
	}
	if err := e.checkIdentity(true); err != nil {
		return Event{}, err
	}
	if err := e.checkOptionalText(); err != nil {
		return Event{}, err
	}

	e.SchemaVersion = 1
	if v := md.Get(MetaEventVersion); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return Event{}, &InvalidEventError{Field: MetaEventVersion, Value: printable(v), Reason: "must be a non-negative integer"}
		}
		e.SchemaVersion = n
	}
	if v := md.Get(MetaAggregateVersion); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n <= 0 {
			return Event{}, &InvalidEventError{Field: MetaAggregateVersion, Value: printable(v), Reason: "must be a positive integer"}
		}
		e.AggregateVersion = n
		e.PreviousVersion = n - 1
	}
	if v, ok := md[MetaPreviousVersion]; ok {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 || n >= e.AggregateVersion {
			return Event{}, &InvalidEventError{Field: MetaPreviousVersion, Value: printable(v),
				Reason: "must be a non-negative integer below aggregate_version, on a versioned event"}
		}
		e.PreviousVersion = n
		if n == 0 && e.AggregateVersion > 1 {
			e.PreviousVersion = NoPreviousVersion
		}
	}
	if v := md.Get(MetaOccurredAt); v != "" {
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			return Event{}, &InvalidEventError{Field: MetaOccurredAt, Value: printable(v), Reason: "must be an RFC 3339 timestamp"}
		}
		e.OccurredAt = t
	}
	for k, v := range md {
		if reservedMeta[k] {
			continue
		}
		if err := checkMetadataEntry(k, v); err != nil {
			return Event{}, err
		}
		if e.Metadata == nil {
			e.Metadata = make(map[string]string)
		}
		e.Metadata[k] = v
	}
	if ctx := msg.Context(); ctx != nil {
		e.Topic = message.SubscribeTopicFromCtx(ctx)
	}
	return e, nil
}
