package middleware_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/versioning"
)

// discardPublisher stands in for a Kafka publisher the constructors only
// keep.
type discardPublisher struct{}

func (discardPublisher) Publish(string, ...*message.Message) error { return nil }
func (discardPublisher) Close() error                              { return nil }

// TestConstructorsRefuseWhatFailsLater: values the constructors accepted
// and that then failed on every event are refused, naming the field. A nil
// *pgxpool.Pool passed DeadLetterConfig.DB's == nil check and panicked on
// the first dead letter (and NewSweeper's, on the first sweep); a
// dead-letter Topic Kafka refuses made every best-effort copy fail; a
// Group with a NUL byte or invalid UTF-8 failed in PostgreSQL on every
// event, and a blank one passed as a name.
func TestConstructorsRefuseWhatFailsLater(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	var nilPool *pgxpool.Pool

	_, err := middleware.NewDeadLetter(middleware.DeadLetterConfig{DB: nilPool, Group: "g", Schema: env.Schema})
	require.ErrorContains(t, err, "middleware.DeadLetterConfig.DB is nil")
	for _, topic := range []string{"a b", "..", "dlq/x"} {
		_, err = middleware.NewDeadLetter(middleware.DeadLetterConfig{DB: env.Pool, Group: "g", Schema: env.Schema,
			Publisher: discardPublisher{}, Topic: topic})
		require.ErrorContains(t, err, "middleware.DeadLetterConfig.Topic", topic)
		_, err = middleware.New(middleware.Config{DB: env.Pool, Group: "g", Schema: env.Schema,
			DeadLetterPublisher: discardPublisher{}, DeadLetterTopic: topic})
		require.ErrorContains(t, err, "DeadLetterConfig.Topic", topic)
	}
	_, err = middleware.NewDeadLetter(middleware.DeadLetterConfig{DB: env.Pool, Group: "g", Schema: env.Schema,
		Publisher: discardPublisher{}, Topic: "orders.dlq"})
	require.NoError(t, err)

	for _, group := range []string{"g\x00", "g-\xff", " "} {
		_, err = middleware.New(middleware.Config{DB: env.Pool, Group: group, Schema: env.Schema})
		require.ErrorContains(t, err, "middleware.Config.Group", "%q", group)
		_, err = middleware.NewGate(middleware.GateConfig{Group: group, Schema: env.Schema})
		require.ErrorContains(t, err, "middleware.GateConfig.Group", "%q", group)
	}

	store, err := versioning.NewStore(env.Schema)
	require.NoError(t, err)
	_, err = store.NewSweeper(nilPool, versioning.SweeperConfig{Group: "g", Apply: func(context.Context, pgx.Tx, versioning.Parked) error { return nil }})
	require.ErrorContains(t, err, "versioning.NewSweeper: db is nil")
}

// TestRegisterIgnoresANilHandler: Register(name, nil) on a middleware
// with Upcasters registered the upcasting wrapper around nil, so the
// sweeper's release of an event parked under that name panicked (in the
// sweeper's goroutine, with nothing to recover it). A nil handler is
// ignored: the release fails with ErrNoHandler, saying what to register.
func TestRegisterIgnoresANilHandler(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	up, err := eventline.NewUpcasters(map[string]int{"thing.changed": 1})
	require.NoError(t, err)
	el, err := middleware.New(middleware.Config{DB: env.Pool, Group: "g", Schema: env.Schema, Upcasters: up, Logger: quiet()})
	require.NoError(t, err)
	el.Register("things-handler", nil)

	msg, err := eventline.Encode(eventline.Event{Type: "thing.changed", AggregateType: "thing", AggregateID: "1", AggregateVersion: 2, Payload: []byte(`{}`)})
	require.NoError(t, err)
	p := versioning.Parked{Group: "g", AggregateType: "thing", AggregateID: "1", Version: 2, EventID: msg.UUID, EventType: "thing.changed",
		Handler: "things-handler", Topic: "things", Payload: msg.Payload, Metadata: msg.Metadata}
	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.NotPanics(t, func() { err = el.Gate().ApplyParked(ctx, tx, p) })
	require.ErrorIs(t, err, versioning.ErrNoHandler)
}
