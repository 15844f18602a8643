package versioning

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
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
	// for this very event (only when Admit deduplicates). Nothing has
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
	// Declared is true when the event declares its predecessor (see
	// [DeclaresPredecessor]): a gap in front of it is one known event,
	// and MaxGap does not bound it.
	Declared bool
	// Parked is how many of the aggregate's events are parked.
	Parked int
}

// Applies reports whether the handler must run (Next or Jump).
func (a Admission) Applies() bool { return a.Verdict == Next || a.Verdict == Jump }

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
// it; see [Follows]) and c the
// aggregate's current version, the event is Stale when v ≤ c, Next when
// p ≤ c < v, and a gap when c < p (Jump when jump is true, the Apply
// policy; Gap otherwise). p < c < v applies: everything the event follows
// has been applied. No version arithmetic is done, so versions up to
// MaxInt64 are safe.
//
//   - the aggregate's aggregate_versions row is created (version 0) or
//     locked until tx ends, so every transaction touching the aggregate,
//     including the sweeper's, serializes on it;
//   - when withDedup is true, the event is recorded in processed_events
//     (outcome applied) first, and an event already recorded yields
//     Duplicate without touching the version, or a *dedup.IDConflictError
//     when the recorded row is a different event with the same id.
//
// Nothing else is written: for Stale and Gap the caller records the outcome
// (see [Store.HoldLate], [Store.Park]); for Jump it records the skipped
// range ([Store.RecordSkipped]). Everything rolls back with tx.
func (s *Store) Admit(ctx context.Context, tx DBTX, group string, e eventline.Event, jump, withDedup bool) (Admission, error) {
	e, err := withFollows(e)
	if err != nil {
		return Admission{}, err
	}
	q, args, err := s.admitQuery(group, e, jump, withDedup)
	if err != nil {
		return Admission{}, err
	}
	var a admitRow
	if err := tx.QueryRow(ctx, q, args...).Scan(a.dest(withDedup)...); err != nil {
		return Admission{}, admitError(e, err)
	}
	return s.decide(ctx, tx, group, e, a)
}

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
		return Admission{}, errors.New("versioning: admission read before the batch results were closed")
	}
	return p.s.decide(ctx, tx, p.group, p.e, p.row)
}

// QueueAdmit queues [Store.Admit] on b. Queued after b.BeginTx, the
// transaction's BEGIN and the admission travel to the server in one round
// trip (this is what the composed middleware does). The admission is
// available from the returned PendingAdmission once the batch results are
// closed; everything else is as for Admit.
func (s *Store) QueueAdmit(b *pgx.Batch, group string, e eventline.Event, jump, withDedup bool) *PendingAdmission {
	e, err := withFollows(e)
	p := &PendingAdmission{s: s, group: group, e: e}
	if err != nil {
		p.err = err
		return p
	}
	q, args, err := s.admitQuery(group, e, jump, withDedup)
	if err != nil {
		p.err = err
		return p
	}
	b.Queue(q, args...).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(p.row.dest(withDedup)...); err != nil {
			p.err = admitError(e, err)
			return p.err
		}
		p.set = true
		return nil
	})
	return p
}

// admitRow is what the admission statement returns: the version row, or
// (with dedup, on a duplicate) NULLs and the recorded event's identity.
type admitRow struct {
	previous, current *int64
	parked            *int
	recorded          dedup.Recorded
}

func (a *admitRow) dest(withDedup bool) []any {
	d := []any{&a.previous, &a.current, &a.parked}
	if withDedup {
		d = append(d, a.recorded.Dest()...)
	}
	return d
}

func admitError(e eventline.Event, err error) error {
	return fmt.Errorf("versioning: admit event %s (%s/%s v%d): %w", e.ID, e.AggregateType, e.AggregateID, e.AggregateVersion, err)
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

// DeclaresPredecessor reports whether e names the version it follows
// below AggregateVersion-1 (aggregate_previous_version on the wire, which
// the producer writes for sparse versions; or NoPreviousVersion): the
// versions in between were never used, and the gate knows exactly which
// event it waits for. An event that follows AggregateVersion-1 says
// nothing about the versions below that, so the gate counts them all as
// missing, and MaxGap bounds only such events: a gap behind a declared
// predecessor is one event the producer published, however far back its
// number is. It is false for an event Follows refuses.
func DeclaresPredecessor(e eventline.Event) bool {
	p, err := Follows(e)
	return err == nil && p < e.AggregateVersion-1
}

// withFollows returns e with PreviousVersion set to Follows(e).
func withFollows(e eventline.Event) (eventline.Event, error) {
	p, err := Follows(e)
	e.PreviousVersion = p
	return e, err
}

func (s *Store) admitQuery(group string, e eventline.Event, jump, withDedup bool) (string, []any, error) {
	if withDedup {
		return s.q.admitDedup, []any{group, e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, jump}, nil
	}
	return s.q.admit, []any{group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, jump}, nil
}

// decide turns the statement's result into a verdict.
func (s *Store) decide(ctx context.Context, tx DBTX, group string, e eventline.Event, r admitRow) (Admission, error) {
	if r.current == nil {
		// No version row came back: the dedup insert conflicted.
		if err := s.dedup.CheckDuplicate(ctx, tx, group, e, r.recorded); err != nil {
			return Admission{}, err
		}
		return Admission{Verdict: Duplicate}, nil
	}
	a := Admission{Previous: *r.previous, Current: *r.current, Parked: *r.parked, Follows: e.PreviousVersion,
		Declared: e.PreviousVersion < e.AggregateVersion-1}
	v, p := e.AggregateVersion, e.PreviousVersion
	switch {
	case a.Previous >= v:
		a.Verdict = Stale
	case a.Current == v && p <= a.Previous:
		a.Verdict = Next
	case a.Current == v:
		a.Verdict = Jump
	default:
		a.Verdict = Gap
	}
	return a, nil
}

// RecordSkipped writes versions from..to of an aggregate to
// skipped_versions with a reason, in tx. It is a no-op when from > to.
func (s *Store) RecordSkipped(ctx context.Context, tx DBTX, k Key, from, to int64, reason string) error {
	if from > to {
		return nil
	}
	if _, err := tx.Exec(ctx, s.q.skip, k.Group, k.AggregateType, k.AggregateID, from, to, reason); err != nil {
		return fmt.Errorf("versioning: record skipped versions %d..%d of %s: %w", from, to, k, err)
	}
	return nil
}

// lock locks an aggregate's row and returns its version and parked count.
// ok is false when the row does not exist or, with skipLocked, when another
// transaction holds it.
func (s *Store) lock(ctx context.Context, tx pgx.Tx, k Key, skipLocked bool) (version int64, parked int, ok bool, err error) {
	q := s.q.lock
	if skipLocked {
		q = s.q.lockSkip
	}
	err = tx.QueryRow(ctx, q, k.Group, k.AggregateType, k.AggregateID).Scan(&version, &parked)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, fmt.Errorf("versioning: lock %s: %w", k, err)
	}
	return version, parked, true, nil
}

// setVersion sets a locked aggregate's version and adjusts its parked count.
func (s *Store) setVersion(ctx context.Context, tx DBTX, k Key, version int64, parkedDelta int) error {
	if _, err := tx.Exec(ctx, s.q.setVersion, k.Group, k.AggregateType, k.AggregateID, version, parkedDelta); err != nil {
		return fmt.Errorf("versioning: set version of %s to %d: %w", k, version, err)
	}
	return nil
}
