package middleware_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

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
