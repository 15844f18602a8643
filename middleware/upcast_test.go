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
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/middleware"
)

// TestUpcastRunsWhenTheEventIsHandled checks the Router path: with
// Config.Upcasters, a handler behind MiddlewareFor written for
// version 2 reads version-1 events, including one parked as written (the
// parked row keeps version 1) and upcast only when released; a version-3
// event fails permanently before the handler, and the message the router
// holds is never modified.
func TestUpcastRunsWhenTheEventIsHandled(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	up, err := eventline.NewUpcasters(nil, eventline.Upcaster{Type: "thing.changed", From: 1, Func: func(p []byte) ([]byte, error) {
		var m map[string]any
		if err := json.Unmarshal(p, &m); err != nil {
			return nil, err
		}
		m["label"] = fmt.Sprintf("thing-%v", m["n"])
		return json.Marshal(m)
	}})
	require.NoError(t, err)
	el, err := middleware.New(env.Pool, middleware.Config{Schema: env.Schema, Group: group, Logger: quiet(), Upcasters: up})
	require.NoError(t, err)

	var mu sync.Mutex
	var seen []string
	handler := func(msg *message.Message) ([]*message.Message, error) {
		e, _ := middleware.EventFromContext(msg.Context())
		var p struct {
			Label string `json:"label"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, err
		}
		mu.Lock()
		seen = append(seen, fmt.Sprintf("v%d schema=%d/%s label=%s", e.AggregateVersion, e.SchemaVersion, msg.Metadata.Get(eventline.MetaEventVersion), p.Label))
		mu.Unlock()
		return nil, nil
	}
	h := el.MiddlewareFor("test")(handler)

	ev := func(version int64, schema int, payload string) *message.Message {
		e := consumertest.Event("a", version)
		e.SchemaVersion, e.Payload = schema, []byte(payload)
		return consumertest.Message(t, e)
	}
	v2 := ev(2, 1, `{"n":2}`)
	_, err = h(v2)
	require.NoError(t, err)
	parked, err := el.Store().ListParked(context.Background(), env.Pool, store.ParkedFilter{Group: group})
	require.NoError(t, err)
	require.Len(t, parked, 1)
	require.JSONEq(t, `{"n":2}`, string(parked[0].Payload), "parked as written")
	require.Equal(t, "1", parked[0].Metadata[eventline.MetaEventVersion])

	v1 := ev(1, 2, `{"n":1,"label":"first"}`)
	_, err = h(v1)
	require.NoError(t, err)
	require.Equal(t, []string{"v1 schema=2/2 label=first", "v2 schema=2/2 label=thing-2"}, seen,
		"the parked version-1 payload is upcast when it is released")

	v3 := ev(3, 3, `{"n":3}`)
	_, err = h(v3)
	require.ErrorIs(t, err, eventline.ErrUnknownSchemaVersion)
	require.True(t, middleware.IsPermanent(err), "an unknown version is dead-lettered, not retried")
	require.Len(t, seen, 2, "the handler never saw it")

	// The router's message is left as written.
	plain := ev(3, 1, `{"n":3}`)
	_, err = h(plain)
	require.NoError(t, err)
	require.Equal(t, "1", plain.Metadata.Get(eventline.MetaEventVersion))
	require.JSONEq(t, `{"n":3}`, string(plain.Payload))
	require.Equal(t, "v3 schema=2/2 label=thing-3", seen[2])
}
