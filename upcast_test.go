package eventline_test

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
)

// The payload of order.created over three schema versions:
//
//	v1 {"amount": 1250}
//	v2 {"amount_cents": 1250}                     (renamed)
//	v3 {"amount_cents": 1250, "currency": "EUR"}  (new field, defaulted)
func renameAmount(p []byte) ([]byte, error) {
	var m map[string]any
	if err := json.Unmarshal(p, &m); err != nil {
		return nil, err
	}
	m["amount_cents"] = m["amount"]
	delete(m, "amount")
	return json.Marshal(m)
}

func addCurrency(p []byte) ([]byte, error) {
	var m map[string]any
	if err := json.Unmarshal(p, &m); err != nil {
		return nil, err
	}
	if _, ok := m["currency"]; !ok {
		m["currency"] = "EUR"
	}
	return json.Marshal(m)
}

func orderUpcasters(t *testing.T) *eventline.Upcasters {
	t.Helper()
	up, err := eventline.NewUpcasters(nil,
		eventline.Upcaster{Type: "order.created", From: 2, Func: addCurrency}, // order does not matter
		eventline.Upcaster{Type: "order.created", From: 1, Func: renameAmount},
	)
	require.NoError(t, err)
	return up
}

func orderEvent(version int, payload string) eventline.Event {
	return eventline.Event{ID: "e1", Type: "order.created", SchemaVersion: version, AggregateType: "order", AggregateID: "o-1", Payload: []byte(payload)}
}

// TestUpcast puts the order.created registry (versions 1 to 3) to events
// of each version it accepts, of a type it does not know and of versions
// it cannot reach, and to a step that fails.
func TestUpcast(t *testing.T) {
	up := orderUpcasters(t)
	t.Run("chains every older version to the current one", func(t *testing.T) {
		cur, ok := up.Current("order.created")
		require.True(t, ok)
		require.Equal(t, 3, cur)

		for _, tc := range []struct {
			version int
			payload string
		}{
			{0, `{"amount":1250}`}, // 0 means the default, 1
			{1, `{"amount":1250}`},
			{2, `{"amount_cents":1250}`},
			{3, `{"amount_cents":1250,"currency":"EUR"}`},
		} {
			in := orderEvent(tc.version, tc.payload)
			out, err := up.Upcast(in)
			require.NoError(t, err, "version %d", tc.version)
			require.Equal(t, 3, out.SchemaVersion)
			require.JSONEq(t, `{"amount_cents":1250,"currency":"EUR"}`, string(out.Payload), "version %d", tc.version)
			require.Equal(t, tc.payload, string(in.Payload), "the input event is not modified")
		}
	})

	t.Run("leaves unknown types alone", func(t *testing.T) {
		in := eventline.Event{ID: "e2", Type: "order.paid", SchemaVersion: 9, Payload: []byte(`{"x":1}`)}
		out, err := up.Upcast(in)
		require.NoError(t, err)
		require.Equal(t, in, out)

		var none *eventline.Upcasters
		out, err = none.Upcast(orderEvent(1, `{"amount":1}`))
		require.NoError(t, err, "a nil registry is empty")
		require.Equal(t, 1, out.SchemaVersion)
	})

	t.Run("rejects versions it cannot reach", func(t *testing.T) {
		_, err := up.Upcast(orderEvent(4, `{"amount_cents":1,"currency":"EUR","tax":0}`))
		var uv *eventline.UnknownSchemaVersionError
		require.ErrorAs(t, err, &uv)
		require.Equal(t, 4, uv.Version)
		require.Equal(t, 3, uv.Current)
		require.ErrorIs(t, err, eventline.ErrUnknownSchemaVersion)
		require.ErrorIs(t, err, eventline.ErrInvalidEvent, "an unknown version is permanent: consumers dead-letter it")
		require.Contains(t, err.Error(), "newer than this consumer's current version 3")

		// Declared current version without steps: only that version passes.
		only, err := eventline.NewUpcasters(map[string]int{"invoice.sent": 2})
		require.NoError(t, err)
		_, err = only.Upcast(eventline.Event{ID: "e3", Type: "invoice.sent", SchemaVersion: 1, Payload: []byte(`{}`)})
		require.ErrorAs(t, err, &uv)
		require.Contains(t, err.Error(), "older than the oldest version 2")
		_, err = only.Upcast(eventline.Event{ID: "e4", Type: "invoice.sent", SchemaVersion: 3, Payload: []byte(`{}`)})
		require.ErrorIs(t, err, eventline.ErrUnknownSchemaVersion)
		_, err = only.Upcast(eventline.Event{ID: "e5", Type: "invoice.sent", SchemaVersion: 2, Payload: []byte(`{}`)})
		require.NoError(t, err)
	})

	t.Run("fails permanently when a step fails", func(t *testing.T) {
		_, err := up.Upcast(orderEvent(1, `[1,2]`)) // not an object: renameAmount fails
		var ue *eventline.UpcastError
		require.ErrorAs(t, err, &ue)
		require.Equal(t, 1, ue.From)
		require.ErrorIs(t, err, eventline.ErrUpcast)
		require.ErrorIs(t, err, eventline.ErrInvalidEvent)

		broken, err := eventline.NewUpcasters(nil, eventline.Upcaster{Type: "t", From: 1, Func: func([]byte) ([]byte, error) { return []byte("{"), nil }})
		require.NoError(t, err)
		_, err = broken.Upcast(eventline.Event{ID: "e6", Type: "t", SchemaVersion: 1, Payload: []byte(`{}`)})
		require.ErrorAs(t, err, &ue)
		require.Contains(t, err.Error(), "not valid JSON")
	})
}

func TestNewUpcastersRejectsBrokenChains(t *testing.T) {
	step := func(typ string, from int) eventline.Upcaster {
		return eventline.Upcaster{Type: typ, From: from, Func: func(p []byte) ([]byte, error) { return p, nil }}
	}
	for name, tc := range map[string]struct {
		current map[string]int
		steps   []eventline.Upcaster
		want    string
	}{
		"hole":             {nil, []eventline.Upcaster{step("a", 1), step("a", 3)}, "no upcaster from version 2 to 3"},
		"short of current": {map[string]int{"a": 4}, []eventline.Upcaster{step("a", 1), step("a", 2)}, "no upcaster from version 3 to 4"},
		"past current":     {map[string]int{"a": 2}, []eventline.Upcaster{step("a", 1), step("a", 2)}, "goes past the current version 2"},
		"duplicate":        {nil, []eventline.Upcaster{step("a", 1), step("a", 1)}, "two upcasters from version 1"},
		"from zero":        {nil, []eventline.Upcaster{step("a", 0)}, "schema versions start at 1"},
		"no type":          {nil, []eventline.Upcaster{step("", 1)}, "Type is empty"},
		"no func":          {nil, []eventline.Upcaster{{Type: "a", From: 1}}, "has no Func"},
		"bad current":      {map[string]int{"a": 0}, nil, "current version 0"},
	} {
		_, err := eventline.NewUpcasters(tc.current, tc.steps...)
		require.ErrorIs(t, err, eventline.ErrInvalidUpcasters, name)
		require.Contains(t, err.Error(), tc.want, name)
	}
	_, err := eventline.NewUpcasters(nil, step("a", 2), step("a", 3))
	require.NoError(t, err, "a chain may start above version 1 (a type first published as version 2)")
	require.False(t, errors.Is(err, eventline.ErrInvalidUpcasters))
}
