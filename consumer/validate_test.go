package consumer_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

// An event that arrives out of order is checked before it may park: its
// type must have a handler, its payload must decode for a HandleJSON
// handler, and a WithValidate check must pass. Otherwise it is refused at
// once (permanent: dead-lettered with the reason) instead of parking and
// failing, or wedging its aggregate, when its turn comes. Before: it
// parked, and after its predecessor arrived it failed on every release.
func TestEventsAreValidatedBeforeTheyPark(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	c, err := consumer.New(env.Pool, consumer.Config{
		Config: middleware.Config{
			Group:  "g",
			Schema: env.Schema,
			Logger: quietLogger(),
		},
		Brokers: []string{"127.0.0.1:9"},
		Topics:  []string{"things"},
	})
	require.NoError(t, err)
	type thing struct{ V int64 }
	require.NoError(t, consumer.HandleJSON(c, "thing.changed", func(context.Context, pgx.Tx, eventline.Event, thing) error { return nil }))
	require.NoError(t, c.Handle("thing.checked", func(context.Context, pgx.Tx, eventline.Event) error { return nil },
		consumer.WithValidate(func(e eventline.Event) error {
			if len(e.Payload) > 10 {
				return eventline.ErrInvalidEvent
			}
			return nil
		})))
	require.NoError(t, c.Ignore("thing.noted"))
	h := consumer.Eventline(c).MiddlewareFor("test")(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	deliver := func(typ string, v int64, payload string) error {
		e := consumertest.Event("a", v)
		e.Type, e.Payload = typ, []byte(payload)
		_, err := h(consumertest.Message(t, e))
		return err
	}
	require.NoError(t, deliver("thing.changed", 1, `{"V":1}`))
	for name, err := range map[string]error{
		"payload does not decode": deliver("thing.changed", 3, `{"V":"three"}`),
		"no handler":              deliver("thing.unknown", 3, `{}`),
		"WithValidate fails":      deliver("thing.checked", 3, `{"long":"payload"}`),
	} {
		require.Error(t, err, name)
		require.True(t, middleware.IsPermanent(err), name)
	}
	require.NoError(t, deliver("thing.noted", 3, `{}`), "an ignored type parks")
	require.NoError(t, deliver("thing.checked", 4, `{}`))
	require.Equal(t, 2, env.Count(t, "parked_events", ""))
}
