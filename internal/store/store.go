// Package store holds the SQL the consumer runs on its tables, in one
// place: processed_events (the dedup records), aggregate_versions,
// parked_events and skipped_versions (the version gate), and the gate's
// and the sweeper's statements on held_events (late events held as the gate
// finds them; package internal/held runs every other statement on that
// table, the relay's included; package admin reads the groups' status).
// Every statement is written as SQL, its tables named
// {schema}.processed_events and so on, and rendered once per schema when a
// [Store] is built.
//
// The middleware, the consumer and the CLI use it; the public packages
// dedup and versioning hold only what users configure or match. Its
// callers validate their input at their own public edge: the store trusts
// it.
package store

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// DBTX is the smallest database handle most calls need (held_events' and
// the store's are one); *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
// Calls that must hold the aggregate lock take a pgx.Tx instead.
type DBTX = held.DBTX

// Beginner starts transactions; *pgxpool.Pool and *pgx.Conn satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Pool is what the sweeper and ReleaseGap need: queries and transactions.
// *pgxpool.Pool satisfies it.
type Pool interface {
	DBTX
	Beginner
}

// Key names one aggregate as seen by one consumer group.
type Key struct {
	// Group is the consumer group.
	Group string
	// AggregateType and AggregateID name the aggregate.
	AggregateType string
	AggregateID   string // see AggregateType
}

// String formats the key as group:type/id, for logs and errors.
func (k Key) String() string { return k.Group + ":" + k.AggregateType + "/" + k.AggregateID }

// Store runs eventline's consumer-side SQL in one schema. It holds no
// connections and is safe for concurrent use.
type Store struct {
	schema string
	sql    []string    // every statement, rendered for schema
	held   *held.Store // held_events: dead letters, late events
}

// New returns a Store for the tables in schema ("" means the default,
// "eventline"). It fails when schema is not a plain SQL identifier.
func New(schema string) (*Store, error) {
	schema = cmp.Or(schema, migrations.DefaultSchema)
	if err := sqlident.Validate("schema", schema); err != nil {
		return nil, err
	}
	s := &Store{schema: schema, sql: make([]string, len(statements)), held: held.New(schema)}
	for i, q := range statements {
		s.sql[i] = sqlident.SQL(schema, q)
	}
	return s, nil
}

// Held returns the store of the schema's held_events.
func (s *Store) Held() *held.Store { return s.held }

// stmt is one of the store's statements (see statement).
type stmt int

// statements are the store's statements as written, with {schema}.
var statements []string

// statement registers query, written as SQL with its tables named
// {schema}.table; every Store renders it once, for its schema. Declare
// statements as package variables, next to the code that runs them.
func statement(query string) stmt {
	statements = append(statements, query)
	return stmt(len(statements) - 1)
}

// q returns the statement rendered for the store's schema.
func (s *Store) q(st stmt) string { return s.sql[st] }

// Current returns the aggregate's last applied version (0 when the group
// has never seen it), without locking.
func (s *Store) Current(ctx context.Context, db DBTX, k Key) (int64, error) {
	var v int64
	err := db.QueryRow(ctx, s.q(currentSQL), k.Group, k.AggregateType, k.AggregateID).Scan(&v)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("eventline: read version of %s: %w", k, err)
	}
	return v, nil
}

var (
	currentSQL = statement(`SELECT version FROM {schema}.aggregate_versions
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3`)
	lockSQL = statement(`SELECT version, parked_count FROM {schema}.aggregate_versions
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE`)
	lockSkipSQL = statement(`SELECT version, parked_count FROM {schema}.aggregate_versions
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE SKIP LOCKED`)
	setVersionSQL = statement(`UPDATE {schema}.aggregate_versions
		SET previous_version = version, version = $4, parked_count = parked_count + $5, updated_at = now()
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3`)
	skipSQL = statement(`INSERT INTO {schema}.skipped_versions (consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason)
		VALUES ($1, $2, $3, $4, $5, $6)`)
)

// lock locks an aggregate's row and returns its version and parked count.
// ok is false when the row does not exist or, with skipLocked, when another
// transaction holds it.
func (s *Store) lock(ctx context.Context, tx pgx.Tx, k Key, skipLocked bool) (version int64, parked int, ok bool, err error) {
	q := lockSQL
	if skipLocked {
		q = lockSkipSQL
	}
	err = tx.QueryRow(ctx, s.q(q), k.Group, k.AggregateType, k.AggregateID).Scan(&version, &parked)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, fmt.Errorf("eventline: lock %s: %w", k, err)
	}
	return version, parked, true, nil
}

// setVersion sets a locked aggregate's version and adjusts its parked count.
func (s *Store) setVersion(ctx context.Context, tx DBTX, k Key, version int64, parkedDelta int) error {
	if _, err := tx.Exec(ctx, s.q(setVersionSQL), k.Group, k.AggregateType, k.AggregateID, version, parkedDelta); err != nil {
		return fmt.Errorf("eventline: set version of %s to %d: %w", k, version, err)
	}
	return nil
}

// RecordSkipped writes versions from..to of an aggregate to
// skipped_versions with a reason, in tx. It is a no-op when from > to.
func (s *Store) RecordSkipped(ctx context.Context, tx DBTX, k Key, from, to int64, reason string) error {
	if from > to {
		return nil
	}
	if _, err := tx.Exec(ctx, s.q(skipSQL), k.Group, k.AggregateType, k.AggregateID, from, to, reason); err != nil {
		return fmt.Errorf("eventline: record skipped versions %d..%d of %s: %w", from, to, k, err)
	}
	return nil
}
