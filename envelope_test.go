package eventline_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
)

func TestEncodeDecodeRoundTrip(t *testing.T) {
	occurred := time.Date(2026, 12, 2, 10, 0, 0, 123456789, time.UTC)
	in := eventline.Event{
		ID: "evt-1", Type: "order.created", SchemaVersion: 2,
		AggregateType: "order", AggregateID: "42", AggregateVersion: 7,
		OccurredAt: occurred, CorrelationID: "req-9", TraceParent: "00-abc-def-01",
		Payload: []byte(`{"amount":10}`), Metadata: map[string]string{"tenant": "acme"},
	}
	msg, err := eventline.Encode(in)
	require.NoError(t, err)
	require.Equal(t, "evt-1", msg.UUID)
	require.Equal(t, "7", msg.Metadata.Get(eventline.MetaAggregateVersion))

	out, err := eventline.Decode(msg)
	require.NoError(t, err)
	in.Topic = ""
	in.PreviousVersion = 6 // absent from the record: the version before
	require.Equal(t, in, out)
}

func TestPreviousVersionTravelsOnlyWhenVersionsHaveAHole(t *testing.T) {
	base := eventline.Event{Type: "t", AggregateType: "a", AggregateID: "1", AggregateVersion: 10, Payload: []byte(`{}`)}

	msg, err := eventline.Encode(base)
	require.NoError(t, err)
	_, written := msg.Metadata[eventline.MetaPreviousVersion]
	require.False(t, written, "no predecessor given: the gate assumes version-1")

	withHole := base
	withHole.PreviousVersion = 4
	msg, err = eventline.Encode(withHole)
	require.NoError(t, err)
	require.Equal(t, "4", msg.Metadata.Get(eventline.MetaPreviousVersion))
	e, err := eventline.Decode(msg)
	require.NoError(t, err)
	require.Equal(t, int64(4), e.PreviousVersion)

	notBelow := base
	notBelow.PreviousVersion = 10
	_, err = eventline.Encode(notBelow)
	require.ErrorIs(t, err, eventline.ErrInvalidEvent)
}

func TestEncodeRejectsMetadataThatCannotBeStored(t *testing.T) {
	for name, md := range map[string]map[string]string{
		"NUL in value":        {"tenant": "a\x00b"},
		"NUL in key":          {"ten\x00ant": "a"},
		"invalid UTF-8 value": {"tenant": "\xff"},
		"reserved key":        {eventline.MetaPreviousVersion: "1"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := eventline.Encode(eventline.Event{Type: "t", AggregateType: "a", AggregateID: "1", Payload: []byte(`{}`), Metadata: md})
			var ie *eventline.InvalidEventError
			require.ErrorAs(t, err, &ie)
			require.Equal(t, "metadata", ie.Field)
		})
	}
}

func TestDecodeNilPayloadIsEmpty(t *testing.T) {
	msg := message.NewMessage("u", nil)
	msg.Metadata = message.Metadata{
		eventline.MetaEventID: "e", eventline.MetaEventType: "t",
		eventline.MetaAggregateType: "a", eventline.MetaAggregateID: "1",
	}
	e, err := eventline.Decode(msg)
	require.NoError(t, err)
	require.NotNil(t, e.Payload, "stored as an empty payload, never NULL")
	require.Empty(t, e.Payload)
}

func TestEncodeFillsDefaults(t *testing.T) {
	msg, err := eventline.Encode(eventline.Event{Type: "t", AggregateType: "a", AggregateID: "1", Payload: []byte(`{}`)})
	require.NoError(t, err)
	e, err := eventline.Decode(msg)
	require.NoError(t, err)
	require.Len(t, e.ID, 36)
	require.Equal(t, 1, e.SchemaVersion)
	require.WithinDuration(t, time.Now(), e.OccurredAt, time.Minute)
	require.Zero(t, e.AggregateVersion, "only the outbox assigns versions")
}

func TestDecodeRejectsBadMetadataWithTypedErrors(t *testing.T) {
	valid := func() message.Metadata {
		return message.Metadata{
			eventline.MetaEventID: "e", eventline.MetaEventType: "t",
			eventline.MetaAggregateType: "a", eventline.MetaAggregateID: "1",
			eventline.MetaAggregateVersion: "3",
		}
	}
	cases := map[string]struct {
		key, value string
		field      string
	}{
		"missing event id":        {eventline.MetaEventID, "", eventline.MetaEventID},
		"missing aggregate id":    {eventline.MetaAggregateID, "", eventline.MetaAggregateID},
		"blank aggregate type":    {eventline.MetaAggregateType, "  ", eventline.MetaAggregateType},
		"non-numeric version":     {eventline.MetaAggregateVersion, "three", eventline.MetaAggregateVersion},
		"negative version":        {eventline.MetaAggregateVersion, "-1", eventline.MetaAggregateVersion},
		"zero version":            {eventline.MetaAggregateVersion, "0", eventline.MetaAggregateVersion},
		"non-numeric schema ver.": {eventline.MetaEventVersion, "v2", eventline.MetaEventVersion},
		"bad timestamp":           {eventline.MetaOccurredAt, "yesterday", eventline.MetaOccurredAt},
		"NUL in id":               {eventline.MetaEventID, "a\x00b", eventline.MetaEventID},
		"NUL in correlation id":   {eventline.MetaCorrelationID, "a\x00b", eventline.MetaCorrelationID},
		"NUL in traceparent":      {eventline.MetaTraceParent, "00-\x00", eventline.MetaTraceParent},
		"bad UTF-8 content type":  {eventline.MetaContentType, "\xff", eventline.MetaContentType},
		"NUL in custom header":    {"tenant", "a\x00b", "metadata"},
		"bad UTF-8 custom header": {"tenant", "\xfe\xff", "metadata"},
		"1 MiB event id":          {eventline.MetaEventID, strings.Repeat("x", 1<<20), eventline.MetaEventID},
		"previous not below":      {eventline.MetaPreviousVersion, "3", eventline.MetaPreviousVersion},
		"previous negative":       {eventline.MetaPreviousVersion, "-1", eventline.MetaPreviousVersion},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			msg := message.NewMessage("uuid", []byte(`{}`))
			msg.Metadata = valid()
			msg.Metadata.Set(c.key, c.value)
			_, err := eventline.Decode(msg)
			require.ErrorIs(t, err, eventline.ErrInvalidEvent)
			var ie *eventline.InvalidEventError
			require.True(t, errors.As(err, &ie))
			require.Equal(t, c.field, ie.Field)
		})
	}
	_, err := eventline.Decode(nil)
	require.ErrorIs(t, err, eventline.ErrInvalidEvent)
}

func TestIsJSON(t *testing.T) {
	for ct, want := range map[string]bool{
		"": true, "application/json": true, "application/json; charset=utf-8": true,
		"application/cloudevents+json": true, "application/protobuf": false, "text/plain": false,
	} {
		require.Equal(t, want, eventline.Event{ContentType: ct}.IsJSON(), ct)
	}
}

// FuzzDecode feeds hostile metadata to Decode: it must return an event or
// an *InvalidEventError, never panic, and what it accepts must encode again.
func FuzzDecode(f *testing.F) {
	f.Add("e", "t", "a", "1", "2", "1", "2026-01-01T00:00:00Z", []byte(`{}`))
	f.Add("", "", "", "", "x", "-1", "bad", []byte(`not json`))
	f.Fuzz(func(t *testing.T, id, typ, aggType, aggID, version, schemaVersion, occurred string, payload []byte) {
		msg := message.NewMessage(id, payload)
		msg.Metadata = message.Metadata{
			eventline.MetaEventID: id, eventline.MetaEventType: typ,
			eventline.MetaAggregateType: aggType, eventline.MetaAggregateID: aggID,
			eventline.MetaAggregateVersion: version, eventline.MetaEventVersion: schemaVersion,
			eventline.MetaOccurredAt: occurred, eventline.MetaContentType: "application/octet-stream",
		}
		e, err := eventline.Decode(msg)
		if err != nil {
			var ie *eventline.InvalidEventError
			if !errors.As(err, &ie) {
				t.Fatalf("untyped error %T: %v", err, err)
			}
			return
		}
		if _, err := eventline.Encode(e); err != nil {
			t.Fatalf("decoded event does not encode: %v (%+v)", err, e)
		}
	})
}

// W3C trace headers other than traceparent travel as ordinary metadata:
// the producer writes the caller's baggage and tracestate there.
func TestBaggageAndTraceStateRoundTripAsMetadata(t *testing.T) {
	in := eventline.Event{
		ID: "evt-1", Type: "t", AggregateType: "a", AggregateID: "1", AggregateVersion: 1, Payload: []byte(`{}`),
		TraceParent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		Metadata:    map[string]string{"baggage": "tenant=acme,user=b%20c;p=1", "tracestate": "vendor=abc"},
	}
	msg, err := eventline.Encode(in)
	require.NoError(t, err)
	require.Equal(t, "tenant=acme,user=b%20c;p=1", msg.Metadata.Get("baggage"))
	out, err := eventline.Decode(msg)
	require.NoError(t, err)
	require.Equal(t, in.Metadata, out.Metadata)
	require.Equal(t, in.TraceParent, out.TraceParent)
}

// A first event numbered above 1 follows no version: NoPreviousVersion in
// the Event, "0" on the wire, and back.
func TestNoPreviousVersionRoundTrips(t *testing.T) {
	base := eventline.Event{ID: "e", Type: "t", AggregateType: "a", AggregateID: "1", AggregateVersion: 5, Payload: []byte(`{}`)}
	first := base
	first.PreviousVersion = eventline.NoPreviousVersion
	msg, err := eventline.Encode(first)
	require.NoError(t, err)
	require.Equal(t, "0", msg.Metadata.Get(eventline.MetaPreviousVersion))
	out, err := eventline.Decode(msg)
	require.NoError(t, err)
	require.Equal(t, eventline.NoPreviousVersion, out.PreviousVersion)

	// Not set: the version before, nothing on the wire.
	msg, err = eventline.Encode(base)
	require.NoError(t, err)
	require.NotContains(t, msg.Metadata, eventline.MetaPreviousVersion)
	out, err = eventline.Decode(msg)
	require.NoError(t, err)
	require.EqualValues(t, 4, out.PreviousVersion)

	// For version 1, following nothing is the normal case.
	one := first
	one.AggregateVersion = 1
	msg, err = eventline.Encode(one)
	require.NoError(t, err)
	require.NotContains(t, msg.Metadata, eventline.MetaPreviousVersion)

	noVersion := first
	noVersion.AggregateVersion = 0
	_, err = eventline.Encode(noVersion)
	require.ErrorIs(t, err, eventline.ErrInvalidEvent)
	below := base
	below.PreviousVersion = -2
	_, err = eventline.Encode(below)
	require.ErrorIs(t, err, eventline.ErrInvalidEvent)
}

// TestOccurredAtOutsideRFC3339IsRefusedAtEncode: an OccurredAt whose UTC
// year has more than four digits (or is negative) used to be encoded, so
// PublishTx accepted it, and then Decode could not read it back: every
// consumer refused the event as malformed. Encode refuses it, naming the
// field; the years RFC 3339 can write round-trip.
func TestOccurredAtOutsideRFC3339IsRefusedAtEncode(t *testing.T) {
	base := eventline.Event{Type: "order.created", AggregateType: "order", AggregateID: "42", Payload: []byte(`{}`)}
	for _, at := range []time.Time{
		time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(99999, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(-5, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(9999, 12, 31, 23, 0, 0, 0, time.FixedZone("EST", -5*3600)), // year 10000 in UTC
	} {
		e := base
		e.OccurredAt = at
		_, err := eventline.Encode(e)
		var ie *eventline.InvalidEventError
		require.ErrorAs(t, err, &ie, at.String())
		require.Equal(t, eventline.MetaOccurredAt, ie.Field)
		require.ErrorIs(t, e.Validate(), eventline.ErrInvalidEvent)
	}
	for _, at := range []time.Time{
		time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(1, 1, 1, 0, 0, 0, 1, time.UTC),
		time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC),
	} {
		e := base
		e.OccurredAt = at
		msg, err := eventline.Encode(e)
		require.NoError(t, err, at.String())
		out, err := eventline.Decode(msg)
		require.NoError(t, err, at.String())
		require.True(t, at.Equal(out.OccurredAt), at.String())
	}
}
