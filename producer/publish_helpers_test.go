package producer_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// closedTx returns a transaction that has already ended: any statement run
// in it fails, so a call that returns its own error with it ran no SQL.
func closedTx(t *testing.T, env pgtest.Env) pgx.Tx {
	t.Helper()
	tx, err := env.Pool.Begin(context.Background())
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(context.Background()))
	return tx
}

// requireUsable checks that tx can still run statements.
func requireUsable(t require.TestingT, tx pgx.Tx) {
	var one int
	require.NoError(t, tx.QueryRow(context.Background(), `SELECT 1`).Scan(&one), "the transaction must still be usable")
}

// storedEvent reads back the event with this id from the outbox, as the
// relay will send it, and the raw envelope metadata.
func storedEvent(t *testing.T, env pgtest.Env, id string) (eventline.Event, map[string]string) {
	t.Helper()
	rows := rowsOf(t, env, id)
	require.Len(t, rows, 1, "event %s must be stored once", id)
	var envelope struct {
		UUID     string            `json:"uuid"`
		Payload  []byte            `json:"payload"`
		Metadata map[string]string `json:"metadata"`
	}
	require.NoError(t, json.Unmarshal([]byte(rows[0].payload), &envelope))
	msg := message.NewMessage(envelope.UUID, envelope.Payload)
	msg.Metadata = envelope.Metadata
	e, err := eventline.Decode(msg)
	require.NoError(t, err)
	return e, envelope.Metadata
}

// sequence returns an aggregate's recorded last version and topic; ok is
// false when it has no sequence row.
func sequence(t require.TestingT, env pgtest.Env, typ, id string) (version int64, topic *string, ok bool) {
	err := env.Pool.QueryRow(context.Background(), `SELECT version, topic FROM `+sqlident.Qualify(env.Schema, "aggregate_sequences")+
		` WHERE aggregate_type = $1 AND aggregate_id = $2`, typ, id).Scan(&version, &topic)
	if err == pgx.ErrNoRows {
		return 0, nil, false
	}
	require.NoError(t, err)
	return version, topic, true
}

func newProducerWith(t *testing.T, env pgtest.Env, cfg producer.Config) *producer.Producer {
	t.Helper()
	cfg.Schema = env.Schema
	if cfg.DefaultTopic == "" {
		cfg.DefaultTopic = "orders"
	}
	p, err := producer.New(context.Background(), env.Pool, cfg)
	require.NoError(t, err)
	return p
}

// versioned returns an order event for aggregate id with a supplied
// version.
func versioned(t *testing.T, id string, version int64) eventline.Event {
	e := orderEvent(t, id)
	e.AggregateVersion = version
	return e
}
