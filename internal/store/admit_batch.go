package store

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/eventline/eventline"
)

// admitBatchSQL admits a whole batch in one statement: it records every
// member in processed_events ($2…$6: event ids, types, aggregate types,
// aggregate ids, versions) and, only when none of them was recorded before,
// creates or locks each aggregate's row once and advances it over the
// batch's members of that aggregate ($7…$11, one element per aggregate, in
// lock order: aggregate type, id, the version its first member follows,
// its last member's version, the Apply policy). The members of one
// aggregate form a chain (each follows the one before: see
// [Store.QueueAdmitBatch]), so admitting them one after the other ends on
// the last one's version exactly when the chain's first version applies:
// the rule of admitSQL with the chain as one event. The first column is how
// many members were recorded now, then, per aggregate, its ordinal in $7
// and its row; when the count is short of the batch, no aggregate row was
// touched and the one row has no other column.
var admitBatchSQL = statement(`WITH u AS (
		SELECT * FROM unnest($7::text[], $8::text[], $9::bigint[], $10::bigint[], $11::boolean[]) WITH ORDINALITY AS u(t, i, p, v, j, n)
	), dedup AS (
		INSERT INTO {schema}.processed_events (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
		SELECT $1, d.e, d.et, d.t, d.i, d.v, 'applied'
		FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[]) AS d(e, et, t, i, v)
		ON CONFLICT DO NOTHING
		RETURNING 1
	), adm AS (
		INSERT INTO {schema}.aggregate_versions AS av (consumer_group, aggregate_type, aggregate_id, version)
		SELECT $1, u.t, u.i, CASE WHEN u.p = 0 OR u.j THEN u.v ELSE 0 END FROM u
		WHERE (SELECT count(*) FROM dedup) = cardinality($2::text[])
		ORDER BY u.n
		ON CONFLICT (consumer_group, aggregate_type, aggregate_id) DO UPDATE
		SET previous_version = av.version,
		    version = (SELECT CASE WHEN u.v > av.version AND (u.p <= av.version OR u.j) THEN u.v ELSE av.version END
		        FROM u WHERE u.t = av.aggregate_type AND u.i = av.aggregate_id),
		    updated_at = now()
		RETURNING av.aggregate_type, av.aggregate_id, av.previous_version, av.version, av.parked_count
	)
	SELECT (SELECT count(*) FROM dedup), u.n, a.previous_version, a.version, a.parked_count
	FROM (SELECT) AS one LEFT JOIN (adm a JOIN u ON u.t = a.aggregate_type AND u.i = a.aggregate_id) ON true`)

// PendingBatch is a batch admission queued by [Store.QueueAdmitBatch].
type PendingBatch struct {
	events []eventline.Event // the members, arrival order, PreviousVersion set to Follows
	jumps  []bool
	chains [][]int // per aggregate, its members in arrival order: a run of the admission order
	fresh  int64
	rows   []chainRow // per chain
	err    error
	set    bool
}

type chainRow struct {
	previous, current int64
	parked            int
	set               bool
}

// QueueAdmitBatch queues on b, in one statement, what [Store.QueueAdmit]
// queued for each event one after the other, in order, which is
// [AdmissionOrder](events) (jumps[i] is Admit's jump for events[i]; the
// caller keeps order to admit the events one by one when one statement
// cannot). It returns nil, queueing nothing, when
// the batch does not have the shape one statement can admit: every event
// versioned (Follows accepts it), and the events of each aggregate a
// chain, each following the version of the one before it (Follows equal
// to its version) under the same jump. Then the caller admits the events
// one by one.
//
// The admission reads as what the events admitted one after the other
// would have read, when no event was recorded before; when one was
// (a duplicate, or an id conflict), Result reports it and the caller rolls
// the transaction back and admits them one by one, which tells which.
func (s *Store) QueueAdmitBatch(b *pgx.Batch, group string, events []eventline.Event, jumps []bool, order []int) *PendingBatch {
	n := len(events)
	p := &PendingBatch{events: make([]eventline.Event, n), jumps: jumps}
	ids, types, atypes, aids := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	versions := make([]int64, n)
	var ctypes, cids []string
	var cfirst, clast []int64
	var cjump []bool
	for k, i := range order {
		e, err := withFollows(events[i])
		if err != nil {
			return nil
		}
		p.events[i] = e
		ids[k], types[k], atypes[k], aids[k], versions[k] = e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion
		if c := len(p.chains) - 1; c >= 0 && ctypes[c] == e.AggregateType && cids[c] == e.AggregateID {
			if clast[c] != e.PreviousVersion || cjump[c] != jumps[i] {
				return nil // not a chain: admitted one by one
			}
			clast[c] = e.AggregateVersion
			p.chains[c] = order[k-len(p.chains[c]) : k+1]
			continue
		}
		p.chains = append(p.chains, order[k:k+1])
		ctypes, cids = append(ctypes, e.AggregateType), append(cids, e.AggregateID)
		cfirst, clast = append(cfirst, e.PreviousVersion), append(clast, e.AggregateVersion)
		cjump = append(cjump, jumps[i])
	}
	p.rows = make([]chainRow, len(p.chains))
	b.Queue(s.q(admitBatchSQL), group, ids, types, atypes, aids, versions, ctypes, cids, cfirst, clast, cjump).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			// Not pointers: NULL (a member recorded before) scans into
			// Valid false without an allocation per column.
			var n, prev, cur pgtype.Int8
			var parked pgtype.Int4
			if err := rows.Scan(&p.fresh, &n, &prev, &cur, &parked); err != nil {
				p.err = err
				return err
			}
			if c := n.Int64 - 1; n.Valid && c >= 0 && c < int64(len(p.rows)) {
				p.rows[c] = chainRow{previous: prev.Int64, current: cur.Int64, parked: int(parked.Int32), set: true}
			}
		}
		if err := rows.Err(); err != nil {
			p.err = fmt.Errorf("eventline: admit a batch of %d events: %w", n, err)
			return p.err
		}
		p.set = true
		return nil
	})
	return p
}

// ErrBatchRecorded is returned by [PendingBatch.Result] when a member of
// the batch had been recorded before: nothing but the other members'
// records was written; roll back and admit the members one by one.
var ErrBatchRecorded = errors.New("eventline: a member of the batch was recorded before")

// Result returns, once the batch's results have been closed, each event's
// admission (in the order given to QueueAdmitBatch), or ErrBatchRecorded.
func (p *PendingBatch) Result() ([]Admission, error) {
	switch {
	case p.err != nil:
		return nil, p.err
	case !p.set:
		return nil, errors.New("eventline: batch admission read before the batch results were closed")
	case p.fresh != int64(len(p.events)):
		return nil, ErrBatchRecorded
	}
	out := make([]Admission, len(p.events))
	for k, members := range p.chains {
		r := p.rows[k]
		if !r.set {
			e := p.events[members[0]]
			return nil, fmt.Errorf("eventline: batch admission returned no version for %s/%s", e.AggregateType, e.AggregateID)
		}
		// What the members' own admissions would have read, one after the
		// other (admitSQL's rule, then admitted's).
		cur := r.previous
		for _, i := range members {
			e := p.events[i]
			prev := cur
			if e.AggregateVersion > cur && (e.PreviousVersion <= cur || p.jumps[i]) {
				cur = e.AggregateVersion
			}
			out[i] = admitted(e, prev, cur, r.parked)
		}
		if cur != r.current {
			e := p.events[members[0]]
			return nil, fmt.Errorf("eventline: batch admission of %s/%s ended on version %d, its events on %d", e.AggregateType, e.AggregateID, r.current, cur)
		}
	}
	return out, nil
}

// AdmissionOrder returns the order in which a batch's admissions are
// queued: by aggregate, so two batches touching the same aggregates lock
// their rows in the same order; stable, so one aggregate's events keep
// their arrival order. Members of different aggregates may be admitted in
// another order than they arrived, which decides nothing: their dedup
// records never collide (an event id is recorded per aggregate), so of two
// members with one id in one aggregate the first to arrive is recorded,
// as one at a time.
func AdmissionOrder(events []eventline.Event) []int {
	order := make([]int, len(events))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(x, y int) int {
		ex, ey := events[x], events[y]
		if c := strings.Compare(ex.AggregateType, ey.AggregateType); c != 0 {
			return c
		}
		return strings.Compare(ex.AggregateID, ey.AggregateID)
	})
	return order
}
