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
	"github.com/eventline/eventline/middleware"
)

// TestUpcastInsideTheSafeChain checks the composition the README shows for
// upcasting on your own Router: middleware.Upcast around the handler,
// mounted with Eventline.Chain and registered by name. A version-1 event
// parked ahead of its predecessor is upcast when it is released; a version
// the upcasters cannot reach is dead-lettered whole by the chain and
// acknowledged, never handed to the handler.
func TestUpcastInsideTheSafeChain(t *testing.T) {
	t.Parallel()
	t.Run("Upcast around the handler", func(t *testing.T) { t.Parallel(); testUpcastInTheChain(t, false) })
	// Config.Upcasters does the same for every handler the middleware
	// wraps or registers: the handler itself knows nothing of upcasting.
	t.Run("Config.Upcasters", func(t *testing.T) { t.Parallel(); testUpcastInTheChain(t, true) })
}

func testUpcastInTheChain(t *testing.T, viaConfig bool) {
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	up, err := eventline.NewUpcasters(map[string]int{"thing.changed": 2}, eventline.Upcaster{Type: "thing.changed", From: 1, Func: func(p []byte) ([]byte, error) {
		var m map[string]any
		if err := json.Unmarshal(p, &m); err != nil {
			return nil, err
		}
		m["label"] = fmt.Sprintf("thing-%v", m["n"])
		return json.Marshal(m)
	}})
	require.NoError(t, err)
	cfg := middleware.Config{DB: env.Pool, Schema: env.Schema, Group: group, Logger: quiet()}
	if viaConfig {
		cfg.Upcasters = up
	}
	el, err := middleware.New(cfg)
	require.NoError(t, err)

	var mu sync.Mutex
	var seen []string
	handler := func(msg *message.Message) ([]*message.Message, error) {
		e, ok := middleware.EventFromContext(msg.Context())
		require.True(t, ok)
		var p struct {
			Label string `json:"label"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, err
		}
		mu.Lock()
		seen = append(seen, fmt.Sprintf("v%d schema=%d label=%s", e.AggregateVersion, e.SchemaVersion, p.Label))
		mu.Unlock()
		return nil, nil
	}
	upcasting := middleware.Upcast(up)(handler)
	if viaConfig {
		upcasting = handler
	}
	el.Register("billing", upcasting)
	chain := el.Chain(upcasting)

	ev := func(version int64, schema int, payload string) *message.Message {
		e := consumertest.Event("a", version)
		e.SchemaVersion, e.Payload = schema, []byte(payload)
		return consumertest.Message(t, e)
	}
	_, err = chain(ev(2, 1, `{"n":2}`)) // parks
	require.NoError(t, err)
	_, err = chain(ev(1, 2, `{"n":1,"label":"first"}`))
	require.NoError(t, err)
	require.Equal(t, []string{"v1 schema=2 label=first", "v2 schema=2 label=thing-2"}, seen,
		"the parked version-1 payload is upcast when it is released")

	_, err = chain(ev(3, 3, `{"n":3}`))
	require.NoError(t, err, "the chain dead-letters what it cannot upcast and acknowledges it")
	require.Len(t, seen, 2, "the handler never sees a version it cannot read")
	dead, err := held.New(env.Schema).List(context.Background(), env.Pool, held.Filter{Group: group})
	require.NoError(t, err)
	require.Len(t, dead, 1)
	require.EqualValues(t, 3, dead[0].AggregateVersion)
	require.JSONEq(t, `{"n":3}`, string(dead[0].Payload), "dead-lettered as written")
}

// With Config.Upcasters, the gate refuses an event the upcasters cannot
// bring to the current version before it parks (or is held as late), as
// the handler would refuse it in order: dead-lettered whole, its
// successors parked behind it until a replay. Before: it parked, failed
// when released, was given up as late, and its successor was applied
// before it.
func TestConfigUpcastersRefuseATooNewEventBeforeItParks(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{Upcasters: func() *eventline.Upcasters {
		up, err := eventline.NewUpcasters(map[string]int{"thing.changed": 2},
			eventline.Upcaster{Type: "thing.changed", From: 1, Func: func(p []byte) ([]byte, error) { return p, nil }})
		require.NoError(t, err)
		return up
	}()})
	ev := func(version int64, schema int) *message.Message {
		e := consumertest.Event("a", version)
		e.SchemaVersion = schema
		return consumertest.Message(t, e)
	}
	require.NoError(t, f.deliver(t, ev(1, 1)))
	err := f.deliver(t, ev(3, 3))
	require.ErrorIs(t, err, eventline.ErrUnknownSchemaVersion)
	require.True(t, middleware.IsPermanent(err), "dead-lettered at once")
	require.Equal(t, 0, f.count(t, "parked_events"))
	require.NoError(t, f.deliver(t, ev(3, 1)), "a version the chain reaches parks")
	require.Equal(t, 1, f.count(t, "parked_events"))
}
