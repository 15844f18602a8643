package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// SkippedWindow is the window GroupStatus.SkippedGapsRecent counts over.
const SkippedWindow = 24 * time.Hour

// DefaultOpenGapsListed is how many open gaps ReadGroupStatus lists (the
// oldest first) when ReadGroupStatusOptions.OpenGapsLimit is 0; all of
// them are counted.
const DefaultOpenGapsListed = 20

// OpenGap is an aggregate whose lowest parked event waits for versions
// that have not arrived: the consumer group is stuck on it.
type OpenGap struct {
	AggregateType string
	AggregateID   string
	// Current is the aggregate's last applied version; the missing
	// versions are Current+1 up to Follows.
	Current int64
	// Follows is the predecessor the lowest parked event (Version) waits
	// for.
	Follows int64
	Version int64 // see Follows
	// Parked counts the aggregate's parked events.
	Parked int64
	// Age is how long the gap has been known: since the aggregate's
	// oldest parked event parked.
	Age time.Duration
}

// GroupStatus is the gap and stall picture of one consumer group, read
// from the database by ReadGroupStatus. On a schema rolled back past
// 003_held_events, LateHeld and DeadLetters are 0.
type GroupStatus struct {
	Group string
	// Parked counts parked events; OldestParked is the age of the oldest
	// (0 when none).
	Parked       int64
	OldestParked time.Duration
	// OpenGapCount counts aggregates whose lowest parked event waits for
	// missing versions; OpenGaps lists the oldest of them (see
	// ReadGroupStatusOptions.OpenGapsLimit) and OldestGap is the age of
	// the oldest.
	OpenGapCount int64
	OpenGaps     []OpenGap
	OldestGap    time.Duration
	// SkippedGapsRecent counts the gaps recorded in skipped_versions in the
	// last SkippedWindow (24 hours), by the sweeper, the Apply policy, a
	// give-up or an operator.
	SkippedGapsRecent int64
	// LateHeld counts the group's late events held for the operator, and
	// DeadLetters its dead letters, not yet replayed or discarded (held
	// events of kind late and dead_letter, status held or
	// replay_requested).
	LateHeld    int64
	DeadLetters int64 // see LateHeld
}

// ReadGroupStatusOptions tune ReadGroupStatus.
type ReadGroupStatusOptions struct {
	// OpenGapsLimit is how many open gaps to list. Defaults to
	// DefaultOpenGapsListed (20); negative lists none.
	OpenGapsLimit int
}

// statusTables says whether the schema has held_events (a schema rolled
// back past 003_held_events has not).
type statusTables struct{ held bool }

var statusTablesSQL = statement(`SELECT to_regclass('{schema}.held_events') IS NOT NULL`)

func (s *Store) statusTables(ctx context.Context, db DBTX) (statusTables, error) {
	var t statusTables
	if err := db.QueryRow(ctx, s.q(statusTablesSQL)).Scan(&t.held); err != nil {
		return t, fmt.Errorf("eventline: look for held_events: %w", err)
	}
	return t, nil
}

// ReadGroupStatus reads the group's parked events, open gaps, recently
// skipped gaps, held late events and unresolved dead letters. It changes
// nothing; run it in a repeatable-read transaction for one snapshot.
func (s *Store) ReadGroupStatus(ctx context.Context, db DBTX, group string, opts ReadGroupStatusOptions) (GroupStatus, error) {
	t, err := s.statusTables(ctx, db)
	if err != nil {
		return GroupStatus{}, err
	}
	return s.readGroupStatus(ctx, db, group, opts, t)
}

// ReadGroupStatuses is ReadGroupStatus for every group that recorded a
// version or a parked event, or holds an open late event or dead letter,
// by group name.
func (s *Store) ReadGroupStatuses(ctx context.Context, db DBTX, opts ReadGroupStatusOptions) ([]GroupStatus, error) {
	t, err := s.statusTables(ctx, db)
	if err != nil {
		return nil, err
	}
	groups, err := s.statusGroups(ctx, db, t)
	if err != nil {
		return nil, err
	}
	out := make([]GroupStatus, 0, len(groups))
	for _, g := range groups {
		st, err := s.readGroupStatus(ctx, db, g, opts, t)
		if err != nil {
			return nil, err
		}
		out = append(out, st)
	}
	return out, nil
}

// The status statements, in a variant for a schema with held_events and
// one for a schema rolled back past 003_held_events (indexed by
// statusTables.held).
var (
	// statusGroupsSQL[held] lists the consumer groups of every table,
	// skipping from one group to the next along each table's index.
	statusGroupsSQL [2]stmt
	// statusCountsSQL[held] counts a group's parked, skipped, late and
	// dead ($1 group, $2 the skipped window in microseconds).
	statusCountsSQL [2]stmt
	// Per aggregate with parked events: the lowest one, the predecessor
	// it waits for and the aggregate's version; a gap is open when that
	// predecessor has not been applied ($1 group, $2 limit).
	openGapsSQL = statement(`SELECT aggregate_type, aggregate_id, current, follows, head, n, age, count(*) OVER () FROM (
			SELECT p.aggregate_type, p.aggregate_id, COALESCE(av.version, 0) AS current, p.follows, p.head, p.n,
				EXTRACT(EPOCH FROM now() - p.oldest)::float8 AS age, p.oldest
			FROM (SELECT aggregate_type, aggregate_id, min(aggregate_version) AS head, count(*) AS n, min(parked_at) AS oldest,
					(array_agg(previous_version ORDER BY aggregate_version))[1] AS follows
				FROM {schema}.parked_events WHERE consumer_group = $1 GROUP BY aggregate_type, aggregate_id) p
			LEFT JOIN {schema}.aggregate_versions av ON av.consumer_group = $1 AND av.aggregate_type = p.aggregate_type AND av.aggregate_id = p.aggregate_id
			WHERE p.follows > COALESCE(av.version, 0)
		) g ORDER BY oldest, aggregate_type, aggregate_id LIMIT greatest($2::bigint, 1)`)
)

func init() {
	// distinctGroups returns the distinct consumer_group values of
	// table's rows that match the condition and (AND …, or ""), by
	// skipping from one group to the next along its index.
	distinctGroups := func(table, and string) string {
		return `(WITH RECURSIVE g(name) AS (
			(SELECT consumer_group FROM {schema}.` + table + ` WHERE true ` + and + ` ORDER BY consumer_group LIMIT 1)
			UNION ALL
			SELECT (SELECT consumer_group FROM {schema}.` + table + ` WHERE consumer_group > g.name ` + and + ` ORDER BY consumer_group LIMIT 1)
			FROM g WHERE g.name IS NOT NULL
		) SELECT name FROM g WHERE name IS NOT NULL)`
	}
	for held := range 2 {
		groups := distinctGroups("aggregate_versions", "") + " UNION " + distinctGroups("parked_events", "")
		late, dead := "0::bigint", "0::bigint"
		if held == 1 {
			// The groups holding open events (the relay's have none),
			// along the index of the open rows.
			groups += " UNION " + distinctGroups("held_events", `AND status IN ('held', 'replay_requested') AND consumer_group <> ''`)
			open := func(kind string) string {
				return `(SELECT count(*) FROM {schema}.held_events WHERE consumer_group = $1 AND kind = '` + kind + `' AND status IN ('held', 'replay_requested'))`
			}
			late, dead = open("late"), open("dead_letter")
		}
		statusGroupsSQL[held] = statement(`SELECT name FROM (` + groups + `) g ORDER BY name`)
		statusCountsSQL[held] = statement(`SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(parked_at)), 0)::float8,
				(SELECT count(*) FROM {schema}.skipped_versions WHERE consumer_group = $1 AND skipped_at > now() - $2::bigint * interval '1 microsecond'),
				` + late + `, ` + dead + `
			FROM {schema}.parked_events WHERE consumer_group = $1`)
	}
}

// b2i is 1 for true.
func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (s *Store) statusGroups(ctx context.Context, db DBTX, t statusTables) ([]string, error) {
	rows, err := db.Query(ctx, s.q(statusGroupsSQL[b2i(t.held)]))
	if err != nil {
		return nil, fmt.Errorf("eventline: list consumer groups: %w", err)
	}
	groups, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("eventline: list consumer groups: %w", err)
	}
	return groups, nil
}

func (s *Store) readGroupStatus(ctx context.Context, db DBTX, group string, opts ReadGroupStatusOptions, t statusTables) (GroupStatus, error) {
	st := GroupStatus{Group: group, OpenGaps: []OpenGap{}}
	var oldest float64
	err := db.QueryRow(ctx, s.q(statusCountsSQL[b2i(t.held)]), group, SkippedWindow.Microseconds()).
		Scan(&st.Parked, &oldest, &st.SkippedGapsRecent, &st.LateHeld, &st.DeadLetters)
	if err != nil {
		return st, fmt.Errorf("eventline: read the status of group %q: %w", group, err)
	}
	st.OldestParked = seconds(oldest)
	if st.Parked == 0 {
		return st, nil
	}
	limit := opts.OpenGapsLimit
	if limit == 0 {
		limit = DefaultOpenGapsListed
	}
	rows, err := db.Query(ctx, s.q(openGapsSQL), group, limit)
	if err != nil {
		return st, fmt.Errorf("eventline: read the open gaps of group %q: %w", group, err)
	}
	defer rows.Close()
	first := true
	for rows.Next() {
		var g OpenGap
		var age float64
		if err := rows.Scan(&g.AggregateType, &g.AggregateID, &g.Current, &g.Follows, &g.Version, &g.Parked, &age, &st.OpenGapCount); err != nil {
			return st, fmt.Errorf("eventline: read the open gaps of group %q: %w", group, err)
		}
		g.Age = seconds(age)
		if first {
			st.OldestGap, first = g.Age, false
		}
		if limit > 0 {
			st.OpenGaps = append(st.OpenGaps, g)
		}
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("eventline: read the open gaps of group %q: %w", group, err)
	}
	return st, nil
}

func seconds(s float64) time.Duration { return time.Duration(max(s, 0) * float64(time.Second)) }
