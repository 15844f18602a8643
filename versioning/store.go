package versioning

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/migrations"
)

// DBTX is the smallest database handle most calls need; *pgxpool.Pool,
// *pgx.Conn and pgx.Tx satisfy it. Calls that must hold the aggregate lock
// take a pgx.Tx instead.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Beginner starts transactions; *pgxpool.Pool and *pgx.Conn satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
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

// Store holds the version gate's SQL for one schema: aggregate_versions,
// parked_events and skipped_versions, plus processed_events through
// [dedup.Store]. It holds no connections and is safe for concurrent use.
type Store struct {
	schema string
	dedup  *dedup.Store
	q      queries
}

// NewStore returns a Store for the tables in schema ("" means the default,
// "eventline"). It fails when schema is not a plain SQL identifier.
func NewStore(schema string) (*Store, error) {
	if schema == "" {
		schema = migrations.DefaultSchema
	}
	if err := sqlident.Validate("versioning schema", schema); err != nil {
		return nil, err
	}
	d, err := dedup.NewStore(schema)
	if err != nil {
		return nil, err
	}
	return &Store{schema: schema, dedup: d, q: newQueries(schema, d.Table())}, nil
}

// Schema returns the schema the store works in.
func (s *Store) Schema() string { return s.schema }

// Dedup returns the store for processed_events in the same schema.
func (s *Store) Dedup() *dedup.Store { return s.dedup }

// Current returns the aggregate's last applied version (0 when the group
// has never seen it), without locking.
func (s *Store) Current(ctx context.Context, db DBTX, k Key) (int64, error) {
	var v int64
	err := db.QueryRow(ctx, s.q.current, k.Group, k.AggregateType, k.AggregateID).Scan(&v)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("versioning: read version of %s: %w", k, err)
	}
	return v, nil
}

// queries is the gate's SQL, schema-qualified once.
type queries struct {
	admitDedup, admit string
	current           string
	lock, lockSkip    string
	setVersion        string
	addParked         string
	park, parkedID    string
	parkedOf          string
	deleteParked      string
	failParked        string
	skip              string
	candidates        string
	countParked       string
	listParked        string
	listSkipped       string
}

func newQueries(schema, processed string) queries {
	av := sqlident.Qualify(schema, "aggregate_versions")
	pe := sqlident.Qualify(schema, "parked_events")
	sv := sqlident.Qualify(schema, "skipped_versions")
	parkedCols := `consumer_group, aggregate_type, aggregate_id, aggregate_version, event_id, event_type, handler, topic,
		payload, metadata, parked_at, release_attempts, coalesce(last_error, ''), last_attempt_at`
	// The upsert below creates the aggregate's row or locks the existing
	// one (ON CONFLICT DO UPDATE waits for, then re-reads, a row another
	// transaction holds), decides in the SET clause whether the event's
	// version $6 advances it (the next version, or any newer one when $7,
	// "jump", is true), and returns the version before and after. So one
	// statement locks, decides and advances; the caller only compares.
	upsert := `INSERT INTO ` + av + ` AS av (consumer_group, aggregate_type, aggregate_id, version)
		%s
		ON CONFLICT (consumer_group, aggregate_type, aggregate_id) DO UPDATE
		SET previous_version = av.version,
		    version = CASE WHEN $6::bigint = av.version + 1 OR ($7::boolean AND $6::bigint > av.version) THEN $6::bigint ELSE av.version END,
		    updated_at = now()
		RETURNING previous_version, version, parked_count`
	newRow := `CASE WHEN $6::bigint = 1 OR $7::boolean THEN $6::bigint ELSE 0 END`
	return queries{
		// With dedup: the processed_events insert runs first in the same
		// statement; when it conflicts (a duplicate) the upsert gets no
		// input row, touches nothing and returns no row.
		admitDedup: `WITH dedup AS (
			INSERT INTO ` + processed + ` (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
			VALUES ($1, $2, $3, $4, $5, $6::bigint, 'applied')
			ON CONFLICT DO NOTHING
			RETURNING 1
		) ` + fmt.Sprintf(upsert, `SELECT $1, $4, $5, `+newRow+` FROM dedup`),
		// Without dedup: the same upsert over ($1 group, $2 type, $3 id,
		// $4 version, $5 jump).
		admit: strings.NewReplacer("$4", "$2", "$5", "$3", "$6", "$4", "$7", "$5").
			Replace(fmt.Sprintf(upsert, `VALUES ($1, $4, $5, `+newRow+`)`)),

		current:  `SELECT version FROM ` + av + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3`,
		lock:     `SELECT version, parked_count FROM ` + av + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE`,
		lockSkip: `SELECT version, parked_count FROM ` + av + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE SKIP LOCKED`,
		setVersion: `UPDATE ` + av + ` SET previous_version = version, version = $4, parked_count = parked_count + $5, updated_at = now()
			WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3`,
		addParked: `UPDATE ` + av + ` SET parked_count = parked_count + $4
			WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3`,

		park: `INSERT INTO ` + pe + ` (consumer_group, aggregate_type, aggregate_id, aggregate_version, event_id, event_type, handler, topic, payload, metadata)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT DO NOTHING`,
		parkedID: `SELECT event_id FROM ` + pe + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4`,
		parkedOf: `SELECT ` + parkedCols + `, (parked_at <= now() - $4::bigint * interval '1 microsecond')
			FROM ` + pe + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
			ORDER BY aggregate_version LIMIT $5`,
		deleteParked: `DELETE FROM ` + pe + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4`,
		failParked: `UPDATE ` + pe + ` SET release_attempts = release_attempts + 1, last_error = $5, last_attempt_at = now()
			WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4`,
		skip: `INSERT INTO ` + sv + ` (consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason)
			VALUES ($1, $2, $3, $4, $5, $6)`,
		candidates: `SELECT aggregate_type, aggregate_id FROM ` + pe + ` WHERE consumer_group = $1
			GROUP BY aggregate_type, aggregate_id ORDER BY min(parked_at) LIMIT $2`,
		countParked: `SELECT count(*) FROM ` + pe + ` WHERE consumer_group = $1`,
		listParked: `SELECT ` + parkedCols + `, false FROM ` + pe + `
			WHERE ($1 = '' OR consumer_group = $1) AND ($2 = '' OR aggregate_type = $2) AND ($3 = '' OR aggregate_id = $3)
			ORDER BY consumer_group, aggregate_type, aggregate_id, aggregate_version LIMIT $4`,
		listSkipped: `SELECT id, consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason, skipped_at FROM ` + sv + `
			WHERE ($1 = '' OR consumer_group = $1) AND ($2 = '' OR aggregate_type = $2) AND ($3 = '' OR aggregate_id = $3)
			ORDER BY id LIMIT $4`,
	}
}
