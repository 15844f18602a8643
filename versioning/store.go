package versioning

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/held"
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
	held   *held.Store
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
	return &Store{schema: schema, dedup: d, held: held.New(schema), q: newQueries(schema, d.Table())}, nil
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
	park              string
	parkedOf          string
	passParked        string
	deleteParked      string
	forget            string
	failParked        string
	skip              string
	candidates        string
	countParked       string
	listParked        string
	listSkipped       string

	holdLate, holdFailed    string
	holdConflict, appliedBy string
}

// parkedCols are the columns collectParked scans, followed by the expired
// and due flags.
const parkedCols = `consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type, handler, topic,
		payload, metadata, parked_at, release_attempts, coalesce(last_error, ''), last_attempt_at, next_attempt_at`

// heldLateCols are the columns of held_events a late event fills: $1
// group, $2 type, $3 id, $4 version, $5 previous version, $6 event id, $7
// event type, $8 handler, $9 topic, $10 payload, $11 and $12 the header
// keys and values (held.Headers), $13 the aggregate's version; the
// message uuid is the event id, as for parked events.
const heldLateCols = `kind, consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type,
		handler, topic, message_uuid, payload, header_keys, header_values, current_version, cause, reason`

// heldLateValues are heldLateCols' values but the cause and reason.
const heldLateValues = `'late', $1, $2, $3, $4::bigint, $5::bigint, $6, $7, $8, $9, convert_to($6, 'UTF8'), $10, $11, $12, $13::bigint`

func newQueries(schema, processed string) queries {
	av := sqlident.Qualify(schema, "aggregate_versions")
	pe := sqlident.Qualify(schema, "parked_events")
	sv := sqlident.Qualify(schema, "skipped_versions")
	he := sqlident.Qualify(schema, "held_events")
	// The upsert below creates the aggregate's row or locks the existing
	// one (ON CONFLICT DO UPDATE waits for, then re-reads, a row another
	// transaction holds), decides in the SET clause whether the event
	// (version $V, previous version $P) advances it: when the version is
	// newer and its predecessor has been applied, or, with $J ("jump",
	// the Apply policy), whenever it is newer. It returns the version
	// before and after. So one statement locks, decides and advances; the
	// caller only compares. No arithmetic: versions up to MaxInt64 are
	// safe.
	upsert := `INSERT INTO ` + av + ` AS av (consumer_group, aggregate_type, aggregate_id, version)
		%s
		ON CONFLICT (consumer_group, aggregate_type, aggregate_id) DO UPDATE
		SET previous_version = av.version,
		    version = CASE WHEN $V::bigint > av.version AND ($P::bigint <= av.version OR $J::boolean) THEN $V::bigint ELSE av.version END,
		    updated_at = now()
		RETURNING previous_version, version, parked_count`
	newRow := `CASE WHEN $P::bigint = 0 OR $J::boolean THEN $V::bigint ELSE 0 END`
	withParams := func(q string, group, typ, id, v, p, j string) string {
		return strings.NewReplacer("$G", group, "$T", typ, "$I", id, "$V", v, "$P", p, "$J", j).Replace(q)
	}
	return queries{
		// With dedup ($1 group, $2 event id, $3 event type, $4 aggregate
		// type, $5 aggregate id, $6 version, $7 previous version, $8
		// jump): the processed_events insert runs first in the same
		// statement; when it conflicts (a duplicate) the upsert gets no
		// input row and touches nothing, and the statement returns the
		// identity of the recorded row instead, so a duplicate is told
		// from an id conflict without another round trip.
		admitDedup: withParams(`WITH dedup AS (
			INSERT INTO `+processed+` (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
			VALUES ($1, $2, $3, $4, $5, $6::bigint, 'applied')
			ON CONFLICT DO NOTHING
			RETURNING 1
		), adm AS (`+fmt.Sprintf(upsert, `SELECT $1, $4, $5, `+newRow+` FROM dedup`)+`)
		SELECT a.previous_version, a.version, a.parked_count, `+dedup.RecordedColumns("r")+`
		FROM (SELECT) AS one LEFT JOIN adm a ON true
		LEFT JOIN (SELECT * FROM `+processed+` WHERE `+dedup.KeyPredicate("", "$1", "$2", "$4", "$5")+`
			AND NOT EXISTS (SELECT 1 FROM dedup)) r ON true`,
			"$1", "$4", "$5", "$6", "$7", "$8"),
		// Without dedup: the upsert over ($1 group, $2 type, $3 id, $4
		// version, $5 previous version, $6 jump).
		admit: withParams(fmt.Sprintf(upsert, `VALUES ($1, $2, $3, `+newRow+`)`), "$1", "$2", "$3", "$4", "$5", "$6"),

		current:  `SELECT version FROM ` + av + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3`,
		lock:     `SELECT version, parked_count FROM ` + av + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE`,
		lockSkip: `SELECT version, parked_count FROM ` + av + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE SKIP LOCKED`,
		setVersion: `UPDATE ` + av + ` SET previous_version = version, version = $4, parked_count = parked_count + $5, updated_at = now()
			WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3`,

		// Park in one statement ($1 group, $2 type, $3 id, $4 version, $5
		// previous version, $6 event id, $7 event type, $8 handler, $9
		// topic, $10 payload, $11 metadata, $12 current version, $13 max
		// gap): known is the highest version applied or parked below the
		// event's predecessor; the event is parked only when it leaves at
		// most $13 versions missing. The count and the dedup outcome
		// follow the insert. The last column names the event already
		// parked under the version, if any (read from the statement's
		// snapshot, which the aggregate's lock keeps current).
		park: `WITH known AS (
				SELECT greatest($12::bigint, coalesce(max(aggregate_version), 0)) AS v FROM ` + pe + `
				WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version <= $5::bigint
			), ins AS (
				INSERT INTO ` + pe + ` (consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version,
					event_id, event_type, handler, topic, payload, metadata)
				SELECT $1, $2, $3, $4::bigint, $5::bigint, $6, $7, $8, $9, $10, $11 FROM known WHERE $5::bigint - known.v <= $13::bigint
				ON CONFLICT DO NOTHING RETURNING 1
			), counted AS (
				UPDATE ` + av + ` SET parked_count = parked_count + 1
				WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND EXISTS (SELECT 1 FROM ins)
			), outcome AS (
				UPDATE ` + processed + ` SET outcome = 'parked'
				WHERE ` + dedup.KeyPredicate("", "$1", "$6", "$2", "$3") + ` AND EXISTS (SELECT 1 FROM ins)
			)
			SELECT EXISTS (SELECT 1 FROM ins), (SELECT v FROM known),
				(SELECT event_id FROM ` + pe + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4::bigint)`,
		parkedOf: `SELECT ` + parkedCols + `, (parked_at <= now() - $4::bigint * interval '1 microsecond'),
				(next_attempt_at IS NULL OR next_attempt_at <= now())
			FROM ` + pe + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
			ORDER BY aggregate_version LIMIT $5`,
		// A parked event whose version the aggregate ($6 = current
		// version) has passed is held as late, with the reason of the
		// skip that covers its version, or $5; its metadata becomes the
		// header columns.
		passParked: `WITH sk AS (
				SELECT reason FROM ` + sv + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
					AND $4::bigint BETWEEN from_version AND to_version ORDER BY id DESC LIMIT 1
			), moved AS (
				DELETE FROM ` + pe + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4::bigint
				RETURNING *
			), held AS (
				INSERT INTO ` + he + ` (` + heldLateCols + `)
				SELECT 'late', m.consumer_group, m.aggregate_type, m.aggregate_id, m.aggregate_version, m.previous_version, m.event_id, m.event_type,
					m.handler, m.topic, convert_to(m.event_id, 'UTF8'), m.payload,
					coalesce((SELECT array_agg(convert_to(k, 'UTF8') ORDER BY k COLLATE "C") FROM jsonb_object_keys(m.metadata) k), '{}'),
					coalesce((SELECT array_agg(convert_to(m.metadata->>k, 'UTF8') ORDER BY k COLLATE "C") FROM jsonb_object_keys(m.metadata) k), '{}'),
					$6::bigint, CASE WHEN EXISTS (SELECT 1 FROM sk) THEN 'arrived_late' ELSE 'passed' END, coalesce((SELECT reason FROM sk), $5)
				FROM moved m ON CONFLICT DO NOTHING
			)
			UPDATE ` + processed + ` SET outcome = 'late'
			WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND event_id IN (SELECT event_id FROM moved)`,
		deleteParked: `DELETE FROM ` + pe + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4`,
		// ($1 group, $2 event id, $3 type, $4 id)
		forget: `DELETE FROM ` + processed + ` WHERE ` + dedup.KeyPredicate("", "$1", "$2", "$3", "$4"),
		// ($1 group, $2 type, $3 id, $4 version, $5 event id, $6 error,
		// $7 backoff in microseconds, $8 attempts)
		failParked: `UPDATE ` + pe + ` SET release_attempts = $8, last_error = $6, last_attempt_at = now(),
				next_attempt_at = now() + $7::bigint * interval '1 microsecond'
			WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4 AND event_id = $5`,
		skip: `INSERT INTO ` + sv + ` (consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason)
			VALUES ($1, $2, $3, $4, $5, $6)`,
		// The sweeper's candidates: aggregates whose lowest parked event
		// is due (no release backoff pending) and either ready (its
		// predecessor applied, or its version passed) or behind a gap
		// older than the park timeout ($3, microseconds). Ordered by when
		// they became due, so aggregates whose events keep failing (each
		// failure pushes its next attempt back) cannot starve the others.
		candidates: `SELECT p.aggregate_type, p.aggregate_id FROM (
				SELECT aggregate_type, aggregate_id, min(parked_at) AS oldest,
					(array_agg(previous_version ORDER BY aggregate_version))[1] AS head_previous,
					(array_agg(next_attempt_at ORDER BY aggregate_version))[1] AS head_next
				FROM ` + pe + ` WHERE consumer_group = $1 GROUP BY aggregate_type, aggregate_id
			) p JOIN ` + av + ` av ON av.consumer_group = $1 AND av.aggregate_type = p.aggregate_type AND av.aggregate_id = p.aggregate_id
			WHERE (p.head_next IS NULL OR p.head_next <= now())
				AND (p.head_previous <= av.version OR p.oldest <= now() - $3::bigint * interval '1 microsecond')
			ORDER BY coalesce(p.head_next, p.oldest) LIMIT $2`,
		countParked: `SELECT count(*) FROM ` + pe + ` WHERE consumer_group = $1`,
		listParked: `SELECT ` + parkedCols + `, false, false FROM ` + pe + `
			WHERE ($1 = '' OR consumer_group = $1) AND ($2 = '' OR aggregate_type = $2) AND ($3 = '' OR aggregate_id = $3)
			ORDER BY consumer_group, aggregate_type, aggregate_id, aggregate_version LIMIT $4`,
		listSkipped: `SELECT id, consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason, skipped_at FROM ` + sv + `
			WHERE ($1 = '' OR consumer_group = $1) AND ($2 = '' OR aggregate_type = $2) AND ($3 = '' OR aggregate_id = $3)
			ORDER BY id LIMIT $4`,

		// A stale event ($4 version <= current) whose version is in
		// skipped_versions is late: with $14 it is held (cause
		// arrived_late, the skip's reason), in the statement that finds it
		// late; its dedup outcome becomes $15 (late, or late_applied when
		// the caller applies it now), else stale. Returns the skip's
		// reason, NULL when the event is merely stale. ($1..$13 as
		// heldLateCols says.)
		holdLate: `WITH sk AS (
				SELECT reason FROM ` + sv + ` WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
					AND $4::bigint BETWEEN from_version AND to_version ORDER BY id DESC LIMIT 1
			), held AS (
				INSERT INTO ` + he + ` (` + heldLateCols + `)
				SELECT ` + heldLateValues + `, 'arrived_late', sk.reason
				FROM sk WHERE $14::boolean ON CONFLICT DO NOTHING RETURNING 1
			), outcome AS (
				UPDATE ` + processed + ` SET outcome = CASE WHEN EXISTS (SELECT 1 FROM sk) THEN $15::text ELSE 'stale' END
				WHERE ` + dedup.KeyPredicate("", "$1", "$6", "$2", "$3") + `
			)
			SELECT (SELECT reason FROM sk)`,
		// A stale event that is not late, held as a version conflict
		// ($1..$13 as for holdLate, $14 the reason); its dedup outcome
		// becomes late.
		holdConflict: `WITH held AS (
				INSERT INTO ` + he + ` (` + heldLateCols + `)
				VALUES (` + heldLateValues + `, 'version_conflict', $14)
				ON CONFLICT DO NOTHING
			)
			UPDATE ` + processed + ` SET outcome = 'late' WHERE ` + dedup.KeyPredicate("", "$1", "$6", "$2", "$3"),
		// ($1 group, $2 type, $3 id, $4 version, $5 event id to leave out)
		appliedBy: `SELECT event_id FROM ` + processed + `
			WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4::bigint
				AND event_id <> $5 AND outcome IN ('applied', 'late_applied')
			ORDER BY processed_at LIMIT 1`,
		// The default dead letter: the given-up parked event is held as
		// late ($1..$13 as for holdLate, $14 the reason, $15 its release
		// attempts, $16 the last error), and its dedup record says late
		// again.
		holdFailed: `WITH held AS (
				INSERT INTO ` + he + ` (` + heldLateCols + `, attempts, last_error, last_attempt_at)
				VALUES (` + heldLateValues + `, 'release_failed', $14, $15, $16, now())
				ON CONFLICT DO NOTHING
			)
			INSERT INTO ` + processed + ` (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
			VALUES ($1, $6, $7, $2, $3, $4::bigint, 'late')
			ON CONFLICT (consumer_group, event_id, aggregate_type, aggregate_id) DO UPDATE SET outcome = 'late'`,
	}
}
