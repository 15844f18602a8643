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
	// Next: the event's version is the aggregate's current version + 1.
	// The version has been advanced; run the handler.
	Next Verdict = iota + 1
	// Jump: a gap under the Apply policy. The version has jumped to the
	// event's; run the handler and record the skipped range.
	Jump
	// Gap: a gap under Park or Reject. Nothing has changed; park or reject
	// the event.
	Gap
	// Stale: the aggregate is already at or past the event's version.
	// Discard the event without running the handler.
	Stale
	// Duplicate: the consumer group has already recorded the event id
	// (only when Admit deduplicates). Nothing has changed.
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
	// Parked is how many of the aggregate's events are parked.
	Parked int
}

// Applies reports whether the handler must run (Next or Jump).
func (a Admission) Applies() bool { return a.Verdict == Next || a.Verdict == Jump }

// Admit decides what to do with a versioned event and, when it applies,
// advances the aggregate's version, all in one statement in tx:
//
//   - the aggregate's aggregate_versions row is created (version 0) or
//     locked until tx ends, so every transaction touching the aggregate,
//     including the sweeper's, serializes on it;
//   - when withDedup is true, the event is recorded in processed_events
//     (outcome applied) first, and an event already recorded yields
//     Duplicate without touching the version;
//   - jump says whether a gap applies the event anyway (the Apply policy).
//
// Nothing else is written: for Stale and Gap the caller records the outcome
// (see [Store.Discard], [Store.Park]); for Jump it records the skipped range
// ([Store.RecordSkipped]). Everything rolls back with tx.
func (s *Store) Admit(ctx context.Context, tx DBTX, group string, e eventline.Event, jump, withDedup bool) (Admission, error) {
	q, args, err := s.admitQuery(group, e, jump, withDedup)
	if err != nil {
		return Admission{}, err
	}
	var a Admission
	err = tx.QueryRow(ctx, q, args...).Scan(&a.Previous, &a.Current, &a.Parked)
	return decide(e, a, err, withDedup)
}

// PendingAdmission is an Admit queued on a pgx.Batch by [Store.QueueAdmit].
type PendingAdmission struct {
	a   Admission
	err error
	set bool
}

// Result returns the admission once the batch's results have been closed.
func (p *PendingAdmission) Result() (Admission, error) {
	if !p.set && p.err == nil {
		return Admission{}, errors.New("versioning: admission read before the batch results were closed")
	}
	return p.a, p.err
}

// QueueAdmit queues [Store.Admit] on b. Queued after b.BeginTx, the
// transaction's BEGIN and the admission travel to the server in one round
// trip (this is what the composed middleware does). The admission is
// available from the returned PendingAdmission once the batch results are
// closed; everything else is as for Admit.
func (s *Store) QueueAdmit(b *pgx.Batch, group string, e eventline.Event, jump, withDedup bool) *PendingAdmission {
	p := &PendingAdmission{}
	q, args, err := s.admitQuery(group, e, jump, withDedup)
	if err != nil {
		p.err = err
		return p
	}
	b.Queue(q, args...).QueryRow(func(row pgx.Row) error {
		var a Admission
		err := row.Scan(&a.Previous, &a.Current, &a.Parked)
		p.a, p.err = decide(e, a, err, withDedup)
		p.set = true
		return p.err
	})
	return p
}

func (s *Store) admitQuery(group string, e eventline.Event, jump, withDedup bool) (string, []any, error) {
	if e.AggregateVersion <= 0 {
		return "", nil, &eventline.InvalidEventError{Field: eventline.MetaAggregateVersion, Reason: "the version gate needs a positive aggregate version"}
	}
	if withDedup {
		return s.q.admitDedup, []any{group, e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, jump}, nil
	}
	return s.q.admit, []any{group, e.AggregateType, e.AggregateID, e.AggregateVersion, jump}, nil
}

// decide turns the upsert's result into a verdict.
func decide(e eventline.Event, a Admission, err error, withDedup bool) (Admission, error) {
	switch {
	case errors.Is(err, pgx.ErrNoRows) && withDedup:
		return Admission{Verdict: Duplicate}, nil
	case err != nil:
		return Admission{}, fmt.Errorf("versioning: admit event %s (%s/%s v%d): %w", e.ID, e.AggregateType, e.AggregateID, e.AggregateVersion, err)
	}
	v := e.AggregateVersion
	switch {
	case a.Previous >= v:
		a.Verdict = Stale
	case a.Current == v && a.Previous == v-1:
		a.Verdict = Next
	case a.Current == v:
		a.Verdict = Jump
	default:
		a.Verdict = Gap
	}
	return a, nil
}

// Discard records a stale event's outcome in processed_events (a no-op when
// the event was not recorded there).
func (s *Store) Discard(ctx context.Context, tx DBTX, group, eventID string) error {
	return s.dedup.SetOutcome(ctx, tx, group, eventID, dedup.OutcomeStale)
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
