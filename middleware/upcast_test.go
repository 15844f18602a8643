package middleware_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/middleware"
)

// upcastBundle is a middleware whose Config.Upcasters bring thing.changed
// from version 1 to 2 (adding a label), and a handler written for version
// 2 that records what it sees: "v<aggregate version> schema=<event's
// schema version>/<message's event_version> label=<label>".
type upcastBundle struct {
	env     consumertest.Env
	el      *middleware.Eventline
	handler message.HandlerFunc
	mu      sync.Mutex
	seen    []string
}

func upcastSetup(t *testing.T) *upcastBundle {
	t.Helper()
	b := &upcastBundle{env: consumertest.New(t, pgtest.Options{MaxConns: 4})}
	up, err := eventline.NewUpcasters(map[string]int{"thing.changed": 2}, eventline.Upcaster{Type: "thing.changed", From: 1, Func: func(p []byte) ([]byte, error) {
		var m map[string]any
		if err := json.Unmarshal(p, &m); err != nil {
			return nil, err
		}
		m["label"] = fmt.Sprintf("thing-%v", m["n"])
		return json.Marshal(m)
	}})
	require.NoError(t, err)
	b.el, err = middleware.New(b.env.Pool, middleware.Config{Schema: b.env.Schema, Group: group, Logger: quiet(), Upcasters: up})
	require.NoError(t, err)
	b.handler = func(msg *message.Message) ([]*message.Message, error) {
		e, ok := middleware.EventFromContext(msg.Context())
		require.True(t, ok)
		var p struct {
			Label string `json:"label"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, err
		}
		b.mu.Lock()
		b.seen = append(b.seen, fmt.Sprintf("v%d schema=%d/%s label=%s", e.AggregateVersion, e.SchemaVersion, msg.Metadata.Get(eventline.MetaEventVersion), p.Label))
		b.mu.Unlock()
		return nil, nil
	}
	return b
}

// ev is a thing.changed of aggregate a at version, written as schema
// version schema with payload.
func ev(t *testing.T, version int64, schema int, payload string) *message.Message {
	e := consumertest.Event("a", version)
	e.SchemaVersion, e.Payload = schema, []byte(payload)
	return consumertest.Message(t, e)
}

func TestUpcast(t *testing.T) {
	t.Parallel()

	// The Router path: a handler behind MiddlewareFor written for version
	// 2 reads version-1 events, including one parked as written (the
	// parked row keeps version 1) and upcast only when released; a
	// version-3 event fails permanently before the handler, and the
	// message the router holds is never modified.
	t.Run("runs when the event is handled", func(t *testing.T) {
		t.Parallel()
		b := upcastSetup(t)
		h := b.el.MiddlewareFor("test")(b.handler)
		_, err := h(ev(t, 2, 1, `{"n":2}`))
		require.NoError(t, err)
		parked, err := b.el.Store().ListParked(context.Background(), b.env.Pool, store.ParkedFilter{Group: group})
		require.NoError(t, err)
		require.Len(t, parked, 1)
		require.JSONEq(t, `{"n":2}`, string(parked[0].Payload), "parked as written")
		require.Equal(t, "1", parked[0].Metadata[eventline.MetaEventVersion])

		_, err = h(ev(t, 1, 2, `{"n":1,"label":"first"}`))
		require.NoError(t, err)
		require.Equal(t, []string{"v1 schema=2/2 label=first", "v2 schema=2/2 label=thing-2"}, b.seen,
			"the parked version-1 payload is upcast when it is released")

		_, err = h(ev(t, 3, 3, `{"n":3}`))
		require.ErrorIs(t, err, eventline.ErrUnknownSchemaVersion)
		require.True(t, middleware.IsPermanent(err), "an unknown version is dead-lettered, not retried")
		require.Len(t, b.seen, 2, "the handler never saw it")

		// The router's message is left as written.
		plain := ev(t, 3, 1, `{"n":3}`)
		_, err = h(plain)
		require.NoError(t, err)
		require.Equal(t, "1", plain.Metadata.Get(eventline.MetaEventVersion))
		require.JSONEq(t, `{"n":3}`, string(plain.Payload))
		require.Equal(t, "v3 schema=2/2 label=thing-3", b.seen[2])
	})

	// Inside the safe chain AddHandler adds (called directly here), the
	// handler knows nothing of upcasting either; a version the upcasters
	// cannot reach is dead-lettered whole by the chain and acknowledged,
	// never handed to the handler.
	t.Run("inside the safe chain", func(t *testing.T) {
		t.Parallel()
		b := upcastSetup(t)
		chain := b.el.Chain("billing", b.handler)
		_, err := chain(ev(t, 2, 1, `{"n":2}`)) // parks
		require.NoError(t, err)
		_, err = chain(ev(t, 1, 2, `{"n":1,"label":"first"}`))
		require.NoError(t, err)
		require.Equal(t, []string{"v1 schema=2/2 label=first", "v2 schema=2/2 label=thing-2"}, b.seen,
			"the parked version-1 payload is upcast when it is released")

		_, err = chain(ev(t, 3, 3, `{"n":3}`))
		require.NoError(t, err, "the chain dead-letters what it cannot upcast and acknowledges it")
		require.Len(t, b.seen, 2, "the handler never sees a version it cannot read")
		dead, err := b.el.DeadLetterStore().List(context.Background(), b.env.Pool, held.Filter{Group: group})
		require.NoError(t, err)
		require.Len(t, dead, 1)
		require.EqualValues(t, 3, dead[0].AggregateVersion)
		require.JSONEq(t, `{"n":3}`, string(dead[0].Payload), "dead-lettered as written")
	})

	// The gate refuses an event the upcasters cannot bring to the current
	// version before it parks (or is held as late), as the handler would
	// refuse it in order: dead-lettered whole, its successors parked behind
	// it until a replay. Before: it parked, failed when released, was given
	// up as late, and its successor was applied before it.
	t.Run("refuses a too-new event before it parks", func(t *testing.T) {
		t.Parallel()
		b := upcastSetup(t)
		h := b.el.MiddlewareFor("test")(b.handler)
		_, err := h(ev(t, 1, 1, `{"n":1}`))
		require.NoError(t, err)
		_, err = h(ev(t, 3, 3, `{"n":3}`))
		require.ErrorIs(t, err, eventline.ErrUnknownSchemaVersion)
		require.True(t, middleware.IsPermanent(err), "dead-lettered at once")
		parked := func() int {
			return b.env.Count(t, "parked_events", "")
		}
		require.Equal(t, 0, parked())
		_, err = h(ev(t, 3, 1, `{"n":3}`))
		require.NoError(t, err, "a version the chain reaches parks")
		require.Equal(t, 1, parked())
	})
}
