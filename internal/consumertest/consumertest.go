// Package consumertest gives consumer-side tests an isolated schema with
// eventline's migrations and a small business model whose handlers record
// every effect, so tests can check that each event was applied once, in
// order.
package consumertest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
)

// TB is what the helpers need from a test: *testing.T, *testing.B and
// *rapid.T satisfy it.
type TB interface {
	Helper()
	Errorf(format string, args ...any)
	FailNow()
}

// Env is one test's schema plus the business tables:
//
//	effects(seq, grp, event_id, aggregate_type, aggregate_id, version) — one row per handler run
//	state(grp, aggregate_type, aggregate_id, value, last_version)      — an order-sensitive fold
type Env struct {
	pgtest.Env
}

// effects and state are the business tables' qualified names.
func (e Env) effects() string { return sqlident.Qualify(e.Schema, "effects") }
func (e Env) state() string   { return sqlident.Qualify(e.Schema, "state") }

// New creates the schema and the business tables.
func New(t testing.TB, opts pgtest.Options) Env {
	t.Helper()
	env := pgtest.New(t, opts)
	e := Env{Env: env}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := env.Pool.Exec(ctx, `
		CREATE TABLE `+e.effects()+` (
			seq bigserial PRIMARY KEY, grp text NOT NULL, event_id text NOT NULL, event_type text NOT NULL,
			aggregate_type text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL);
		CREATE TABLE `+e.state()+` (
			grp text NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
			value bigint NOT NULL, last_version bigint NOT NULL,
			PRIMARY KEY (grp, aggregate_type, aggregate_id));`)
	require.NoError(t, err)
	return e
}

// Count counts the rows of the schema's table that where (SQL after the
// table name, such as "WHERE consumer_group = $1"; empty for all) selects,
// with args.
func (e Env) Count(t testing.TB, table, where string, args ...any) int {
	t.Helper()
	return pgtest.Count(t, e.Pool, `SELECT count(*) FROM `+sqlident.Qualify(e.Schema, table)+" "+where, args...)
}

// CreateTable creates the table name (columns is its definition inside
// the parentheses) in the schema and returns its qualified name.
func (e Env) CreateTable(t testing.TB, name, columns string) string {
	t.Helper()
	table := sqlident.Qualify(e.Schema, name)
	_, err := e.Pool.Exec(context.Background(), `CREATE TABLE `+table+` (`+columns+`)`)
	require.NoError(t, err)
	return table
}

// Fold is the state update Apply performs: value' = (value*31 + version) mod p.
// It depends on the order versions are applied in.
func Fold(value, version int64) int64 { return (value*31 + version) % 1_000_000_007 }

// Apply is a business handler: it records the effect and folds the version
// into the aggregate's state, through tx.
func (e Env) Apply(ctx context.Context, tx pgx.Tx, group string, ev eventline.Event) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+e.effects()+` (grp, event_id, event_type, aggregate_type, aggregate_id, version) VALUES ($1, $2, $3, $4, $5, $6)`,
		group, ev.ID, ev.Type, ev.AggregateType, ev.AggregateID, ev.AggregateVersion)
	if err != nil {
		return fmt.Errorf("insert effect: %w", err)
	}
	_, err = tx.Exec(ctx, `INSERT INTO `+e.state()+` AS s (grp, aggregate_type, aggregate_id, value, last_version) VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT (grp, aggregate_type, aggregate_id) DO UPDATE SET value = (s.value * 31 + $5) % 1000000007, last_version = $5`,
		group, ev.AggregateType, ev.AggregateID, Fold(0, ev.AggregateVersion), ev.AggregateVersion)
	if err != nil {
		return fmt.Errorf("update state: %w", err)
	}
	return nil
}

// Effect is one recorded handler run.
type Effect struct {
	Seq           int64
	EventID       string
	EventType     string
	AggregateType string
	AggregateID   string
	Version       int64
}

// Effects returns the group's effects in the order they were applied
// (commit order of their inserts is not guaranteed across aggregates, but
// within one aggregate the row lock makes seq order the apply order).
func (e Env) Effects(t TB, group string) []Effect {
	t.Helper()
	rows, err := e.Pool.Query(context.Background(), `SELECT seq, event_id, event_type, aggregate_type, aggregate_id, version FROM `+e.effects()+` WHERE grp = $1 ORDER BY seq`, group)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Effect, error) {
		var x Effect
		return x, r.Scan(&x.Seq, &x.EventID, &x.EventType, &x.AggregateType, &x.AggregateID, &x.Version)
	})
	require.NoError(t, err)
	return out
}

// Transactions returns, per event id, the id of the transaction that
// wrote the group's effect of it (PostgreSQL's xmin).
func (e Env) Transactions(t TB, group string) map[string]string {
	t.Helper()
	rows, err := e.Pool.Query(context.Background(), `SELECT event_id, xmin::text FROM `+e.effects()+` WHERE grp = $1`, group)
	require.NoError(t, err)
	out := map[string]string{}
	for rows.Next() {
		var id, xmin string
		require.NoError(t, rows.Scan(&id, &xmin))
		out[id] = xmin
	}
	require.NoError(t, rows.Err())
	return out
}

// State returns the folded value and last version of an aggregate (0, 0
// when nothing was applied).
func (e Env) State(t TB, group, aggregateType, aggregateID string) (value, lastVersion int64) {
	t.Helper()
	err := e.Pool.QueryRow(context.Background(), `SELECT value, last_version FROM `+e.state()+` WHERE grp = $1 AND aggregate_type = $2 AND aggregate_id = $3`,
		group, aggregateType, aggregateID).Scan(&value, &lastVersion)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, 0
	}
	require.NoError(t, err)
	return value, lastVersion
}

// Event returns a JSON event of type "thing.changed" for an aggregate of
// type "thing" at the given version, with a fresh id.
func Event(aggregateID string, version int64) eventline.Event {
	payload, _ := json.Marshal(map[string]any{"id": aggregateID, "v": version})
	return eventline.Event{
		ID:               eventline.NewEventID(),
		Type:             "thing.changed",
		AggregateType:    "thing",
		AggregateID:      aggregateID,
		AggregateVersion: version,
		Payload:          payload,
	}
}

// Message encodes an event as the relay would publish it.
func Message(t TB, e eventline.Event) *message.Message {
	t.Helper()
	msg, err := eventline.Encode(e)
	require.NoError(t, err)
	return msg
}

// Redeliver returns a fresh copy of msg, as a broker would deliver it again.
func Redeliver(msg *message.Message) *message.Message {
	c := message.NewMessage(msg.UUID, append([]byte(nil), msg.Payload...))
	for k, v := range msg.Metadata {
		c.Metadata.Set(k, v)
	}
	return c
}
