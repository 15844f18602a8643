package consumer_test

// What an event must pass before it may park: its payload must upcast to
// the version its handler reads, its type must have a handler, and the
// handler's checks must pass.

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/eventlinetest/kafkatest"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

// orderV3 is version 3 of the order.created payload. Version 1 was
// {"amount": n} (whole cents), version 2 renamed it {"amount_cents": n},
// version 3 added a currency, which was always EUR before.
type orderV3 struct {
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

func orderUpcasters(t *testing.T) *eventline.Upcasters {
	t.Helper()
	edit := func(fn func(map[string]any)) func([]byte) ([]byte, error) {
		return func(p []byte) ([]byte, error) {
			var m map[string]any
			if err := json.Unmarshal(p, &m); err != nil {
				return nil, err
			}
			fn(m)
			return json.Marshal(m)
		}
	}
	up, err := eventline.NewUpcasters(map[string]int{"order.created": 3},
		eventline.Upcaster{Type: "order.created", From: 1, Func: edit(func(m map[string]any) {
			m["amount_cents"] = m["amount"]
			delete(m, "amount")
		})},
		eventline.Upcaster{Type: "order.created", From: 2, Func: edit(func(m map[string]any) { m["currency"] = "EUR" })},
	)
	require.NoError(t, err)
	return up
}

// TestUpcastersLetAVersion3HandlerReadVersions1To3 publishes order.created
// events written as schema versions 1, 2 and 3 (one of them parked behind a
// missing aggregate version and released later) and one written as version
// 4, to a consumer whose handler reads version 3. The first four are
// applied with the right amounts and currencies; the version-4 record is
// dead-lettered, permanently, with a reason naming both versions, and the
// partition moves on.
func TestUpcastersLetAVersion3HandlerReadVersions1To3(t *testing.T) {
	t.Parallel()
	const group = "billing"
	k := kafkatest.Start(t)
	env := kenv{
		Env:     consumertest.New(t, pgtest.Options{MaxConns: 6}),
		brokers: k.Brokers,
		topic:   kafkatest.Topic("orders"),
	}
	k.CreateTopic(t, env.topic, 2)
	ctx := context.Background()
	seen := env.CreateTable(t, "orders_seen", `order_id text, aggregate_version bigint, amount_cents bigint, currency text, PRIMARY KEY (order_id, aggregate_version)`)

	cfg := env.config(group)
	cfg.Upcasters = orderUpcasters(t)
	reg := withMetrics(t, &cfg)
	c, err := consumer.New(env.Pool, cfg)
	require.NoError(t, err)
	require.NoError(t, consumer.HandleJSON(c, "order.created", func(ctx context.Context, tx pgx.Tx, e eventline.Event, o orderV3) error {
		if e.SchemaVersion != 3 {
			return fmt.Errorf("handler got schema version %d", e.SchemaVersion)
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+seen+` VALUES ($1, $2, $3, $4)`, e.AggregateID, e.AggregateVersion, o.AmountCents, o.Currency)
		return err
	}))

	ev := func(id string, version int64, schema int, payload string) eventline.Event {
		return eventline.Event{ID: eventline.NewEventID(), Type: "order.created", SchemaVersion: schema,
			AggregateType: "order", AggregateID: id, AggregateVersion: version, Payload: []byte(payload)}
	}
	published := []eventline.Event{
		ev("o-1", 1, 1, `{"amount":1000}`),
		ev("o-2", 1, 2, `{"amount_cents":2000}`),
		ev("o-3", 1, 3, `{"amount_cents":3000,"currency":"USD"}`),
		// o-4's version 2, an old version-1 payload, arrives before its
		// version 1: it is parked as written and upcast when released.
		ev("o-4", 2, 1, `{"amount":4200}`),
		ev("o-4", 1, 3, `{"amount_cents":4100,"currency":"GBP"}`),
		// Written by a newer producer than this consumer knows.
		ev("o-9", 1, 4, `{"amount_cents":9000,"currency":"EUR","tax_cents":900}`),
	}
	require.NoError(t, kafkatest.Publish(ctx, env.brokers, env.topic, published...))
	r := start(t, c)

	count := func() int { return pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+seen) }
	deadLettered := func() float64 { return metrictest.Sum(t, reg, "eventline_consumer_events_dead_lettered_total") }
	eventually(t, 60*time.Second, func() bool { return count() == 5 && deadLettered() == 1 }, "5 orders applied and 1 dead letter")
	require.NoError(t, r.stop())

	rows, err := env.Pool.Query(ctx, `SELECT order_id, aggregate_version, amount_cents, currency FROM `+seen+` ORDER BY 1, 2`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var id, cur string
		var v, amount int64
		err := r.Scan(&id, &v, &amount, &cur)
		return fmt.Sprintf("%s v%d %d %s", id, v, amount, cur), err
	})
	require.NoError(t, err)
	for _, e := range published {
		t.Logf("published %s v%d as schema %d %s", e.AggregateID, e.AggregateVersion, e.SchemaVersion, e.Payload)
	}
	t.Logf("the version-3 handler wrote:\n  %s", strings.Join(got, "\n  "))
	require.Equal(t, []string{
		"o-1 v1 1000 EUR",
		"o-2 v1 2000 EUR",
		"o-3 v1 3000 USD",
		"o-4 v1 4100 GBP",
		"o-4 v2 4200 EUR",
	}, got)

	dead := deadLetters(t, env, group, 1)
	reason := dead[0].Reason
	t.Logf("dead letter: %s v%d schema %s, cause=%s, reason: %s", dead[0].AggregateID, dead[0].AggregateVersion,
		dead[0].Metadata[eventline.MetaEventVersion], dead[0].Cause, reason)
	require.Equal(t, "o-9", dead[0].AggregateID)
	require.Equal(t, "4", dead[0].Metadata[eventline.MetaEventVersion], "the dead letter keeps the record as written")
	require.Equal(t, dedup.KindPermanent, dead[0].Cause, "an unknown version is not retried")
	require.Contains(t, reason, "has payload schema version 4, newer than this consumer's current version 3")
	require.Zero(t, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+seen+` WHERE order_id = 'o-9'`))
}

// An event whose payload schema version is newer than the consumer's
// upcasters know (eventline.ErrUnknownSchemaVersion) is refused when it
// arrives out of order, as in order: dead-lettered, not parked. Its
// successors park behind it, and once a consumer that knows the version
// gets it (a replay after the upgrade), the aggregate is applied in
// order. Before: the runner's check let it park; when its predecessor
// came, its release failed for good, its version was given up as skipped,
// the event held as late, and its successor applied before it.
func TestEventTooNewForTheUpcastersIsRefusedBeforeItParks(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	const group = "billing"
	var applied []int64
	newConsumer := func(up *eventline.Upcasters) message.HandlerFunc {
		c, err := consumer.New(env.Pool, consumer.Config{
			Config: middleware.Config{
				Group:     group,
				Schema:    env.Schema,
				Upcasters: up,
				Logger:    quietLogger(),
			},
			Brokers: []string{"127.0.0.1:9"},
			Topics:  []string{"orders"},
		})
		require.NoError(t, err)
		require.NoError(t, consumer.HandleJSON(c, "order.created", func(context.Context, pgx.Tx, eventline.Event, orderV3) error { return nil }))
		require.NoError(t, c.Handle("order.noted", func(context.Context, pgx.Tx, eventline.Event) error { return nil }))
		return consumer.Eventline(c).MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
			e, _ := middleware.EventFromContext(msg.Context())
			applied = append(applied, e.AggregateVersion)
			return nil, nil
		})
	}
	ev := func(typ string, version int64, schema int) *message.Message {
		return consumertest.Message(t, eventline.Event{ID: eventline.NewEventID(), Type: typ, SchemaVersion: schema,
			AggregateType: "order", AggregateID: "o-1", AggregateVersion: version, Payload: []byte(`{"amount_cents":100,"currency":"EUR"}`)})
	}
	up, err := eventline.NewUpcasters(map[string]int{"order.created": 3, "order.noted": 1})
	require.NoError(t, err)
	h := newConsumer(up)
	deliver := func(h message.HandlerFunc, msg *message.Message) error {
		_, err := h(consumertest.Redeliver(msg))
		return err
	}

	require.NoError(t, deliver(h, ev("order.created", 1, 3)))
	tooNew := ev("order.created", 3, 4)
	for _, msg := range []*message.Message{tooNew, ev("order.noted", 3, 2)} { // a HandleJSON handler, and a plain one
		err := deliver(h, msg)
		require.ErrorIs(t, err, eventline.ErrUnknownSchemaVersion, "refused before parking")
		require.True(t, middleware.IsPermanent(err), "dead-lettered at once")
	}
	parked := func() int {
		return env.Count(t, "parked_events", "")
	}
	require.Zero(t, parked())
	require.NoError(t, deliver(h, ev("order.created", 2, 3)))
	require.NoError(t, deliver(h, ev("order.created", 4, 3)), "v4 parks behind the refused v3")
	require.Equal(t, 1, parked())
	require.Equal(t, []int64{1, 2}, applied)

	// The consumer is upgraded; the dead letter is replayed.
	up4, err := eventline.NewUpcasters(map[string]int{"order.created": 4, "order.noted": 1},
		eventline.Upcaster{Type: "order.created", From: 3, Func: func(p []byte) ([]byte, error) { return p, nil }})
	require.NoError(t, err)
	require.NoError(t, deliver(newConsumer(up4), tooNew))
	require.Equal(t, []int64{1, 2, 3, 4}, applied, "applied in order")
	require.Zero(t, parked())
	require.Zero(t, env.Count(t, "held_events", `WHERE kind = 'late'`))
}

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
