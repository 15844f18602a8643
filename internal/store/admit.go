package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/eventline/eventline"
)

// Verdict is the gate's decision about one versioned event.
type Verdict int

// The verdicts of [Store.Admit].
const (
	// Next: the event's predecessor has been applied (the aggregate's
	// current version is at or past the event's previous version, and
	// below its version). The version has been advanced; run the handler.
	Next Verdict = iota + 1
	// Jump: a gap under the Apply policy. The version has jumped to the
	// event's; run the handler and record the skipped range.
	Jump
	// Gap: a gap under Park. Nothing has changed; park the event.
	Gap
	// Stale: the aggregate is already at or past the event's version.
	// The handler does not run; the event is discarded, or held as late
	// when its version was given up on (see [Store.HoldLate]).
	Stale
	// Duplicate: the consumer group has already recorded the event id
	// for this very event. Nothing has
	// changed.
	Duplicate
)

// String names the verdict ("next", "jump", "gap", "stale", "duplicate").
func (v Verdict) String() string {
	switch v {
	case Next:
		return "next"
	case Jump:
		return "jump"
	case Gap:
		return "gap"
	case Stale:
		return "stale"
	case Duplicate:
		return "duplicate"
	}
	return fmt.Sprintf("Verdict(%d)", int(v))
}

// Admission is the outcome of [Store.Admit].
type Admission struct {
	// Verdict is the decision.
	Verdict Verdict
	// Previous is the aggregate's version before the event (0 for an
	// aggregate the group has not seen).
	Previous int64
	// Current is the aggregate's version after Admit: the event's version
	// for Next and Jump, unchanged otherwise.
	Current int64
	// Follows is the version the event follows (see [Follows]).
	Follows int64
	// Declared is true when the event names the version it follows below
	// its AggregateVersion-1 (aggregate_previous_version on the wire,
	// which the producer writes for sparse versions; or
	// NoPreviousVersion): the versions in between were never used, and the
	// gap in front of it is one known event, however far back its number
	// is, which MaxGap does not bound. An event that follows
	// AggregateVersion-1 says nothing about the versions below that, so
	// all of them count as missing, and MaxGap bounds them.
	Declared bool
	// Parked is how many of the aggregate's events are parked.
	Parked int
}

// Missing is the number of versions missing in front of the event, for a
// Gap or a Jump: Previous+1 up to Follows. For an event that declares its
// predecessor these are versions, not events: the producer may not have
// used them.
func (a Admission) Missing() int64 {
	if a.Follows <= a.Previous {
		return 0
	}
	return a.Follows - a.Previous
}

// Admit decides what to do with a versioned event and, when it applies,
// advances the aggregate's version, all in one statement in tx.
//
// The rule: with v the event's AggregateVersion, p the version it follows
// (its PreviousVersion, or v-1 when that is 0, as eventline.Encode writes
// it; see [Follows]) and c the aggregate's current version, the event is
// Stale when v ≤ c, Next when p ≤ c < v, and a gap when c < p (Jump when
// jump is true, the Apply policy; Gap otherwise). p < c < v applies:
// everything the event follows has been applied. No version arithmetic is
// done, so versions up to MaxInt64 are safe.
//
//   - the event is recorded in processed_events (outcome applied) first;
//     an event already recorded yields Duplicate without touching the
//     version, or a *dedup.IDConflictError when the recorded row is a
//     different event of the aggregate with the same id;
//   - the aggregate's aggregate_versions row is created (version 0) or
//     locked until tx ends, so every transaction touching the aggregate,
//     including the sweeper's, serializes on it.
//
// Nothing else is written: for Stale and Gap the caller records the outcome
// (see [Store.HoldLate], [Store.Park]); for Jump it records the skipped
// range ([Store.RecordSkipped]). Everything rolls back with tx.
func (s *Store) Admit(ctx context.Context, tx pgx.Tx, group string, e eventline.Event, jump bool) (Admission, error) {
	b := &pgx.Batch{}
	p := s.QueueAdmit(b, group, e, jump)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return Admission{}, err
	}
	return p.Result(ctx, tx)
}

// admitSQL records the event in processed_events and, unless it was
// recorded before (a duplicate), creates or locks its aggregate's row and
// decides, in the SET clause, whether the event advances it ($1 group, $2
// event id, $3 event type, $4 aggregate type, $5 aggregate id, $6 version,
// $7 previous version, $8 jump): when the version is newer and its
// predecessor has been applied, or, with $8 (the Apply policy), whenever
// it is newer. ON CONFLICT DO UPDATE waits for, then re-reads, a row
// another transaction holds. It returns the version before and after; on
// a duplicate the upsert gets no input row and touches nothing, and the
// statement returns the identity of the recorded row instead, so a
// duplicate is told from an id conflict without another round trip. No
// arithmetic: versions up to MaxInt64 are safe.
var admitSQL = statement(`WITH dedup AS (
		INSERT INTO {schema}.processed_events (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
		VALUES ($1, $2, $3, $4, $5, $6::bigint, 'applied')
		ON CONFLICT DO NOTHING
		RETURNING 1
	), adm AS (
		INSERT INTO {schema}.aggregate_versions AS av (consumer_group, aggregate_type, aggregate_id, version)
		SELECT $1, $4, $5, CASE WHEN $7::bigint = 0 OR $8::boolean THEN $6::bigint ELSE 0 END FROM dedup
		ON CONFLICT (consumer_group, aggregate_type, aggregate_id) DO UPDATE
		SET previous_version = av.version,
		    version = CASE WHEN $6::bigint > av.version AND ($7::bigint <= av.version OR $8::boolean) THEN $6::bigint ELSE av.version END,
		    updated_at = now()
		RETURNING previous_version, version, parked_count
	)
	SELECT a.previous_version, a.version, a.parked_count, r.event_type, r.aggregate_type, r.aggregate_id, r.aggregate_version
	FROM (SELECT) AS one LEFT JOIN adm a ON true
	LEFT JOIN (SELECT * FROM {schema}.processed_events
		WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $4 AND aggregate_id = $5
			AND NOT EXISTS (SELECT 1 FROM dedup)) r ON true`)

// PendingAdmission is an Admit queued on a pgx.Batch by [Store.QueueAdmit].
type PendingAdmission struct {
	s     *Store
	group string
	e     eventline.Event
	row   admitRow
	err   error
	set   bool
}

// Result returns the admission once the batch's results have been closed.
// tx is the batch's transaction: in the rare case of a duplicate recorded
// by a concurrent transaction, the recorded row is read again through it
// to tell a duplicate from an id conflict.
func (p *PendingAdmission) Result(ctx context.Context, tx DBTX) (Admission, error) {
	switch {
	case p.err != nil:
		return Admission{}, p.err
	case !p.set:
		return Admission{}, errors.New("eventline: admission read before the batch results were closed")
	case !p.row.current.Valid:
		// No version row came back: the dedup insert conflicted.
		if err := p.s.checkDuplicate(ctx, tx, p.group, p.e, p.row.recorded); err != nil {
			return Admission{}, err
		}
		return Admission{Verdict: Duplicate}, nil
	}
	return admitted(p.e, p.row.previous.Int64, p.row.current.Int64, int(p.row.parked.Int32)), nil
}

// QueueAdmit queues [Store.Admit] on b. Queued after b.BeginTx, the
// transaction's BEGIN and the admission travel to the server in one round
// trip (this is what the middleware does). The admission is available from
// the returned PendingAdmission once the batch results are closed;
// everything else is as for Admit.
func (s *Store) QueueAdmit(b *pgx.Batch, group string, e eventline.Event, jump bool) *PendingAdmission {
	e, err := withFollows(e)
	p := &PendingAdmission{s: s, group: group, e: e}
	if err != nil {
		p.err = err
		return p
	}
	args := []any{group, e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, jump}
	b.Queue(s.q(admitSQL), args...).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(p.row.dest()...); err != nil {
			p.err = fmt.Errorf("eventline: admit event %s (%s/%s v%d): %w", e.ID, e.AggregateType, e.AggregateID, e.AggregateVersion, err)
			return p.err
		}
		p.set = true
		return nil
	})
	return p
}

// admitRow is what the admission statement returns: the version row, or
// (on a duplicate) NULLs and the recorded event's identity.
type admitRow struct {
	previous, current pgtype.Int8 // values, not pointers: no allocation per column
	parked            pgtype.Int4
	recorded          recorded
}

func (a *admitRow) dest() []any {
	return append([]any{&a.previous, &a.current, &a.parked}, a.recorded.dest()...)
}

// Follows returns the aggregate version e follows: e.PreviousVersion; 0
// when that is eventline.NoPreviousVersion (the aggregate's first event,
// numbered above 1: the record says it follows version 0); or, when it is 0
// (not set: Encode writes it only when it is not AggregateVersion-1, and
// Decode then sets AggregateVersion-1), AggregateVersion-1. It fails for an
// unversioned event or a previous version at or above the version.
func Follows(e eventline.Event) (int64, error) {
	switch {
	case e.AggregateVersion <= 0:
		return 0, &eventline.InvalidEventError{Field: eventline.MetaAggregateVersion, Reason: "the version gate needs a positive aggregate version"}
	case e.PreviousVersion == eventline.NoPreviousVersion:
		return 0, nil
	case e.PreviousVersion < 0 || e.PreviousVersion >= e.AggregateVersion:
		return 0, &eventline.InvalidEventError{Field: eventline.MetaPreviousVersion, Value: fmt.Sprint(e.PreviousVersion),
			Reason: "must be below aggregate_version and not negative"}
	case e.PreviousVersion == 0:
		return e.AggregateVersion - 1, nil
	}
	return e.PreviousVersion, nil
}

// withFollows returns e with PreviousVersion set to Follows(e).
func withFollows(e eventline.Event) (eventline.Event, error) {
	p, err := Follows(e)
	e.PreviousVersion = p
	return e, err
}

// admitted is e's admission from its aggregate's version before and after
// it (previous, current); e.PreviousVersion is Follows(e).
func admitted(e eventline.Event, previous, current int64, parked int) Admission {
	v, p := e.AggregateVersion, e.PreviousVersion
	a := Admission{Verdict: Gap, Previous: previous, Current: current, Parked: parked, Follows: p, Declared: p < v-1}
	switch {
	case previous >= v:
		a.Verdict = Stale
	case current == v && p <= previous:
		a.Verdict = Next
	case current == v:
		a.Verdict = Jump
	}
	return a
}
