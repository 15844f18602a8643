package versioning

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/held"
)

// LateRequest describes a stale event to check against skipped_versions.
type LateRequest struct {
	// Group is the consumer group.
	Group string
	// Event is the event; Message the message as received (nil: the event
	// is re-encoded).
	Event   eventline.Event
	Message *message.Message
	// Handler and Topic are the Watermill handler name and topic it
	// arrived on.
	Handler string
	Topic   string // see Handler
	// Current is the aggregate's version.
	Current int64
	// Hold holds the event (held_events, kind late) when it is late (HoldLate);
	// false only checks and records the outcome late_applied, for a
	// caller that applies the event now (ApplyLate).
	Hold bool
}

// HoldLate settles a stale event (Admit returned Stale) in tx, which holds
// the aggregate's lock, in one statement. When its version is recorded in
// skipped_versions the event is late: with r.Hold it is held for the
// operator (held_events: kind late, cause arrived_late) and its dedup
// outcome becomes late;
// without, its outcome becomes late_applied and the caller must apply it
// now (and roll back if that fails). Otherwise it is merely stale (a
// redelivery whose dedup record expired, or a second event claiming an
// applied version): its outcome becomes stale. late reports which, and
// reason is the skip's reason.
//
// An event whose metadata cannot be stored byte-exact is refused with an
// *eventline.InvalidEventError, before anything is written.
func (s *Store) HoldLate(ctx context.Context, tx DBTX, r LateRequest) (late bool, reason string, err error) {
	e, err := withFollows(r.Event)
	if err != nil {
		return false, "", err
	}
	payload, md, err := storedMessage(e, r.Message)
	if err != nil {
		return false, "", err
	}
	outcome := dedup.OutcomeLate
	if !r.Hold {
		outcome = dedup.OutcomeLateApplied
	}
	var why *string
	hk, hv := held.Headers(md)
	err = tx.QueryRow(ctx, s.q.holdLate, r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, e.ID, e.Type,
		r.Handler, r.Topic, payload, hk, hv, r.Current, r.Hold, string(outcome)).Scan(&why)
	if err != nil {
		return false, "", contentError(fmt.Errorf("versioning: settle stale event %s: %w", e.ID, err))
	}
	if why == nil {
		return false, "", nil
	}
	return true, *why, nil
}

// HoldConflict holds a stale event that is not late (Admit returned Stale
// and HoldLate found its version was not given up on) for the operator, in
// tx, which holds the aggregate's lock: held_events, kind late, cause
// version_conflict; its dedup outcome late. Its reason names the event
// recorded in processed_events as applying the version
// (see [Store.AppliedBy]), or says none is recorded (a successor declared
// an earlier predecessor, or the record of the event that applied it
// expired). The gate calls it for a replayed dead letter, which is an
// event that was never applied: a stale verdict means its version was
// taken while it was dead, which an operator must settle (apply it late,
// or discard it), not a duplicate to drop.
//
// An event whose metadata cannot be stored byte-exact is refused with an
// *eventline.InvalidEventError, before anything is written.
func (s *Store) HoldConflict(ctx context.Context, tx DBTX, r LateRequest) (reason string, err error) {
	e, err := withFollows(r.Event)
	if err != nil {
		return "", err
	}
	payload, md, err := storedMessage(e, r.Message)
	if err != nil {
		return "", err
	}
	k := Key{Group: r.Group, AggregateType: e.AggregateType, AggregateID: e.AggregateID}
	by, found, err := s.AppliedBy(ctx, tx, k, e.AggregateVersion, e.ID)
	if err != nil {
		return "", err
	}
	reason = fmt.Sprintf("version %d was applied by event %s", e.AggregateVersion, by)
	if !found {
		reason = fmt.Sprintf("the aggregate passed version %d without this event (it is at v%d), and no other event is recorded as applying it: "+
			"a later event declared an earlier predecessor, or the record of the event that applied it (this one, maybe) expired",
			e.AggregateVersion, r.Current)
	}
	hk, hv := held.Headers(md)
	_, err = tx.Exec(ctx, s.q.holdConflict, r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, e.ID, e.Type,
		r.Handler, r.Topic, payload, hk, hv, r.Current, reason)
	if err != nil {
		return "", contentError(fmt.Errorf("versioning: hold conflicting event %s: %w", e.ID, err))
	}
	return reason, nil
}

// AppliedBy returns the id of an event, other than exceptID, that the
// group recorded in processed_events as applied (in order or late) with
// the aggregate's given version, the first one recorded; found is false
// when none is recorded (never applied, or its record expired). It
// filters the group's records by aggregate, so it belongs on rare paths:
// an index that leads with the aggregate makes it a range scan over that
// aggregate's records, without one it reads the group's.
func (s *Store) AppliedBy(ctx context.Context, db DBTX, k Key, version int64, exceptID string) (eventID string, found bool, err error) {
	err = db.QueryRow(ctx, s.q.appliedBy, k.Group, k.AggregateType, k.AggregateID, version, exceptID).Scan(&eventID)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("versioning: find the event that applied %s v%d: %w", k, version, err)
	}
	return eventID, true, nil
}

// HoldFailed is the default DeadLetterFunc: it holds a parked event the
// gate gave up on for the operator (held_events: kind late, cause
// release_failed) with reason, and records its dedup outcome as late, so
// redeliveries are duplicates while an operator decides (`eventline held
// list`, `replay`, `discard`).
func (s *Store) HoldFailed(ctx context.Context, tx pgx.Tx, p Parked, reason string) error {
	current, err := s.Current(ctx, tx, p.Key())
	if err != nil {
		return err
	}
	payload := p.Payload
	if payload == nil {
		payload = []byte{}
	}
	hk, hv := held.Headers(p.Metadata)
	_, err = tx.Exec(ctx, s.q.holdFailed, p.Group, p.AggregateType, p.AggregateID, p.Version, p.PreviousVersion, p.EventID,
		p.EventType, p.Handler, p.Topic, payload, hk, hv, current, reason, p.ReleaseAttempts, p.LastError)
	if err != nil {
		return fmt.Errorf("versioning: hold given-up event %s: %w", p.EventID, err)
	}
	return nil
}

// passParked holds a parked event whose version the aggregate has passed
// (current) as late.
func (s *Store) passParked(ctx context.Context, tx pgx.Tx, p Parked, current int64) error {
	reason := fmt.Sprintf("the aggregate reached v%d without applying %s: another event claimed its version, or a successor declared an earlier predecessor", current, p.describe())
	if _, err := tx.Exec(ctx, s.q.passParked, p.Group, p.AggregateType, p.AggregateID, p.Version, reason, current); err != nil {
		return fmt.Errorf("versioning: hold passed parked event %s as late: %w", p.EventID, err)
	}
	return nil
}

// applyLate applies an aggregate's late events whose replay an operator
// requested, in tx holding the aggregate's lock: each in a savepoint with
// p.Late set. A success marks the event replayed (outcome late_applied); a
// failure is recorded with a backoff, and after opts.MaxAttempts failures
// (or a permanent one) it is held again with its last error for the
// operator.
func (s *Store) applyLate(ctx context.Context, tx pgx.Tx, k Key, opts ReleaseOptions, res *SweepResult) error {
	late, err := s.held.LockLate(ctx, tx, k.Group, held.Aggregate{Type: k.AggregateType, ID: k.AggregateID}, drainLimit)
	if err != nil {
		return fmt.Errorf("versioning: %w", err)
	}
	for _, l := range late {
		p := lateParked(l)
		herr, err := s.attempt(ctx, tx, p, opts.Apply, nil)
		if err != nil {
			return err
		}
		if herr == nil {
			if err := s.held.MarkLateApplied(ctx, tx, l.ID); err != nil {
				return fmt.Errorf("versioning: %w", err)
			}
			res.LateApplied++
			continue
		}
		res.LateFailed++
		attempts := l.Attempts + 1
		giveUp := attempts >= opts.MaxAttempts || (opts.Permanent != nil && opts.Permanent(herr))
		if err := s.held.MarkReplayFailed(ctx, tx, l.ID, herr.Error(), opts.backoff(attempts), giveUp); err != nil {
			return fmt.Errorf("versioning: %w", err)
		}
	}
	return nil
}

// lateParked is a late event as the sweeper applies it.
func lateParked(l held.Event) Parked {
	p := Parked{Group: l.Group, AggregateType: l.AggregateType, AggregateID: l.AggregateID, Version: l.AggregateVersion,
		PreviousVersion: l.PreviousVersion, EventID: l.EventID, EventType: l.EventType, Handler: l.Handler, Topic: l.Topic,
		Payload: l.Payload, Metadata: l.Metadata, ParkedAt: l.HeldAt, ReleaseAttempts: l.Attempts, LastError: l.LastError,
		Late: true, due: true}
	if l.LastAttemptAt != nil {
		p.LastAttemptAt = *l.LastAttemptAt
	}
	return p
}
