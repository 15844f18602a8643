package verify

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrEffectsQuery is wrapped by the error Run returns when a group's
// effects query cannot run or returns the wrong columns.
var ErrEffectsQuery = errors.New("eventline verify: effects query")

// twiceRow is an event the effects query returns N times, and its dedup
// record, if any.
type twiceRow struct {
	EventID                    string
	N                          int64
	AggregateType, AggregateID string
	Version                    int64
	EventType                  string
	At                         *time.Time
}

// twiceSQL finds the event ids the effects query ({effects}) returns
// more than once for group $1, with their dedup record. Dedup records are
// kept per event id and aggregate, so an id a producer reused in several
// aggregates is that many events: their effects count against the records
// whose handler ran.
const twiceSQL = `SELECT DISTINCT ON (d.event_id) d.event_id, d.n, COALESCE(p.aggregate_type, ''), COALESCE(p.aggregate_id, ''),
		COALESCE(p.aggregate_version, 0), COALESCE(p.event_type, ''), p.processed_at
	FROM (SELECT event_id::text AS event_id, count(*) AS n FROM {effects} GROUP BY 1 HAVING count(*) > 1) d
	LEFT JOIN {schema}.processed_events p ON p.consumer_group = $1 AND p.event_id = d.event_id
	WHERE d.n > GREATEST(1, (SELECT count(*) FROM {schema}.processed_events h
		WHERE h.consumer_group = $1 AND h.event_id = d.event_id AND h.outcome IN ('applied', 'late_applied')))
	ORDER BY d.event_id, p.processed_at`

// effectsOrderSQL finds the applied events of group $1 whose effects came
// after those of a higher version of their aggregate, in the order of the
// effects query's second column.
var effectsOrderSQL = `SELECT ` + eventColumnsOf("s", "processed_at") + `, s.before
	FROM (
		SELECT p.consumer_group, p.aggregate_type, p.aggregate_id, p.aggregate_version, p.event_id, p.event_type, p.processed_at,
			max(p.aggregate_version) OVER (` + aggregateWindow + ` ORDER BY e.seq, p.aggregate_version
				ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
		FROM {effects}
		JOIN {schema}.processed_events p ON p.consumer_group = $1 AND p.event_id = e.event_id::text
		WHERE p.outcome = 'applied' AND p.aggregate_version > 0
			-- An id recorded in several aggregates (reused by a producer) does
			-- not say which aggregate an effect was for: left out.
			AND NOT EXISTS (SELECT 1 FROM {schema}.processed_events o WHERE o.consumer_group = $1 AND o.event_id = p.event_id
				AND (o.aggregate_type, o.aggregate_id) <> (p.aggregate_type, p.aggregate_id))
	) s WHERE s.aggregate_version < s.before`

// checkEffects runs a group's effects query (see Config.EffectsQueries) in
// a savepoint of the consumer snapshot: events applied twice, and, when the
// query returns an ordering column, versions applied out of order.
func (r *runner) checkEffects(ctx context.Context, tx pgx.Tx, gs *groupState, query string) error {
	group := gs.rep.Group
	q := trimQuery(query)
	fail := func(err error) error {
		if err == nil {
			return nil
		}
		var pgErr *pgconn.PgError
		hint := ""
		if errors.As(err, &pgErr) {
			hint = ": " + pgErr.Message
		}
		return fmt.Errorf("%w of group %q failed%s; it must be a SELECT returning the event id, and optionally a column that orders the effects (%v)",
			ErrEffectsQuery, group, hint, err)
	}
	var columns int
	err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		rows, err := sp.Query(ctx, `SELECT * FROM (`+q+`) AS effects LIMIT 0`)
		if err != nil {
			return err
		}
		columns = len(rows.FieldDescriptions())
		rows.Close()
		return rows.Err()
	})
	if err != nil {
		return fail(err)
	}
	if columns < 1 || columns > 2 {
		return fmt.Errorf("%w of group %q returns %d columns; return the event id, and optionally a column that orders the effects",
			ErrEffectsQuery, group, columns)
	}
	effects := "(" + q + ") AS e(event_id)"
	if columns == 2 {
		effects = "(" + q + ") AS e(event_id, seq)"
	}
	// The query is placed after rendering, so nothing in it is taken for
	// a placeholder.
	render := func(query string) string { return strings.Replace(r.consumerSQL(query), "{effects}", effects, 1) }
	var twice int64
	gs.rep.AppliedTwice = &twice
	err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		return each(ctx, sp, "read the effects", func(d twiceRow) {
			twice++
			f := Finding{Severity: Problem, Kind: AppliedTwice, Group: group, EventID: d.EventID, EventType: d.EventType,
				AggregateType: d.AggregateType, AggregateID: d.AggregateID, AggregateVersion: d.Version,
				Detail: fmt.Sprintf("the group's effects query returns this event %d times", d.N)}
			if d.At != nil {
				f.At, f.AgeSeconds = d.At, max(r.consumerNow.Sub(*d.At), 0).Seconds()
			}
			r.details.add(f)
		}, render(twiceSQL), group)
	})
	if err != nil || columns < 2 {
		return fail(err)
	}
	gs.orderFromEffects = true
	err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		return each(ctx, sp, "read the order of the effects", func(o versionRow[int64]) {
			r.outOfOrder(gs, o, "its effects, in the order of the effects query's second column")
		}, render(effectsOrderSQL), group)
	})
	return fail(err)
}

// outOfOrder records an event applied after a higher version of its
// aggregate (o.Other).
func (r *runner) outOfOrder(gs *groupState, o versionRow[int64], by string) {
	gs.rep.OutOfOrder++
	r.details.add(o.finding(Problem, OutOfOrder, r.consumerNow, fmt.Sprintf("v%d was applied after v%d, by %s", o.Version, o.Other, by)))
}
