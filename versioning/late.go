package versioning

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
)

// LateKind says how an event came to be held in late_events.
type LateKind string

// The kinds of late events.
const (
	// LateArrived: the event arrived after its version had been given up
	// on (it is in skipped_versions): after the park timeout, under the
	// Apply policy, or by an operator's release.
	LateArrived LateKind = "arrived_late"
	// LatePassed: the aggregate passed the event's version without it
	// (another event claimed the version, or a successor declared an
	// earlier predecessor). Either the event was parked, or it is a
	// replayed dead letter that arrived after that (see
	// [Store.HoldConflict]; its reason starts with
	// [ConflictReasonPrefix]).
	LatePassed LateKind = "passed"
	// LateReleaseFailed: the event was parked and could not be applied
	// within the release-attempt limit (or failed permanently); the
	// default DeadLetterFunc holds it here, its version recorded as
	// skipped.
	LateReleaseFailed LateKind = "release_failed"
)

// LateEvent is an event held in late_events: received, never applied,
// and its aggregate is past its version. Its processed_events outcome is
// late, so redeliveries are duplicates.
type LateEvent struct {
	// Parked holds the event as stored (Late is true; ParkedAt is when it
	// was held; ReleaseAttempts, LastError, LastAttemptAt and
	// NextAttemptAt describe operator-requested applies that failed).
	Parked
	// Kind says how the event came here; Reason why (the skip's reason,
	// or the last release error).
	Kind   LateKind
	Reason string // see Kind
	// CurrentVersion was the aggregate's version when the event was held.
	CurrentVersion int64
	// ApplyRequestedAt is set when an operator asked for the event to be
	// applied (RequestLateApply); the consumer's sweeper applies it.
	ApplyRequestedAt time.Time
}

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
	// Hold stores the event in late_events when it is late (HoldLate);
	// false only checks and records the outcome late_applied, for a
	// caller that applies the event now (ApplyLate).
	Hold bool
}

// HoldLate settles a stale event (Admit returned Stale) in tx, which holds
// the aggregate's lock, in one statement. When its version is recorded in
// skipped_versions the event is late: with r.Hold it is stored in
// late_events (kind arrived_late) and its dedup outcome becomes late;
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
	err = tx.QueryRow(ctx, s.q.holdLate, r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, e.ID, e.Type,
		r.Handler, r.Topic, payload, md, r.Current, r.Hold, string(outcome)).Scan(&why)
	if err != nil {
		return false, "", contentError(fmt.Errorf("versioning: settle stale event %s: %w", e.ID, err))
	}
	if why == nil {
		return false, "", nil
	}
	return true, *why, nil
}

// ConflictReasonPrefix starts the reason of an event held by
// [Store.HoldConflict].
const ConflictReasonPrefix = "version_conflict: "

// HoldConflict holds a stale event that is not late (Admit returned Stale
// and HoldLate found its version was not given up on) in late_events for
// the operator, in tx, which holds the aggregate's lock: kind passed, its
// dedup outcome late. Its reason starts with ConflictReasonPrefix and
// names the event recorded in processed_events as applying the version
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
	reason = fmt.Sprintf("%sversion %d was applied by event %s", ConflictReasonPrefix, e.AggregateVersion, by)
	if !found {
		reason = fmt.Sprintf("%sthe aggregate passed version %d without this event (it is at v%d), and no other event is recorded as applying it: "+
			"a later event declared an earlier predecessor, or the record of the event that applied it (this one, maybe) expired",
			ConflictReasonPrefix, e.AggregateVersion, r.Current)
	}
	_, err = tx.Exec(ctx, s.q.holdConflict, r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, e.ID, e.Type,
		r.Handler, r.Topic, payload, md, r.Current, reason)
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

// HoldFailed is the default DeadLetterFunc: it keeps a parked event the
// gate gave up on in late_events (kind release_failed) with reason, and
// records its dedup outcome as late, so redeliveries are duplicates while
// an operator decides (`eventline parked late`, `apply-late`,
// `discard-late`).
func (s *Store) HoldFailed(ctx context.Context, tx pgx.Tx, p Parked, reason string) error {
	current, err := s.Current(ctx, tx, p.Key())
	if err != nil {
		return err
	}
	payload := p.Payload
	if payload == nil {
		payload = []byte{}
	}
	md := p.Metadata
	if md == nil {
		md = map[string]string{}
	}
	_, err = tx.Exec(ctx, s.q.holdFailed, p.Group, p.EventID, p.AggregateType, p.AggregateID, p.Version, p.PreviousVersion,
		p.EventType, p.Handler, p.Topic, payload, md, reason, current, p.ReleaseAttempts, p.LastError)
	if err != nil {
		return fmt.Errorf("versioning: hold given-up event %s in late_events: %w", p.EventID, err)
	}
	return nil
}

// passParked moves a parked event whose version the aggregate has passed
// (current) to late_events.
func (s *Store) passParked(ctx context.Context, tx pgx.Tx, p Parked, current int64) error {
	reason := fmt.Sprintf("the aggregate reached v%d without applying %s: another event claimed its version, or a successor declared an earlier predecessor", current, p.describe())
	if _, err := tx.Exec(ctx, s.q.passParked, p.Group, p.AggregateType, p.AggregateID, p.Version, reason, current); err != nil {
		return fmt.Errorf("versioning: move passed parked event %s to late_events: %w", p.EventID, err)
	}
	return nil
}

// LateFilter selects late events for [Store.ListLate]. Empty fields match
// everything.
type LateFilter struct {
	// Group, AggregateType and AggregateID select exact values.
	Group         string
	AggregateType string // see Group
	AggregateID   string // see Group
	// Limit caps the result. Defaults to 100.
	Limit int
}

// ListLate returns late events ordered by group, aggregate and version.
// It takes no locks (it backs `eventline parked late`).
func (s *Store) ListLate(ctx context.Context, db DBTX, f LateFilter) ([]LateEvent, error) {
	if f.Limit <= 0 {
		f.Limit = DefaultListLimit
	}
	rows, err := db.Query(ctx, s.q.listLate, f.Group, f.AggregateType, f.AggregateID, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("versioning: list late events: %w", err)
	}
	return collectLate(rows)
}

func collectLate(rows pgx.Rows) ([]LateEvent, error) {
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (LateEvent, error) {
		var l LateEvent
		var last, next, requested *time.Time
		var kind string
		err := r.Scan(&l.Group, &l.AggregateType, &l.AggregateID, &l.Version, &l.PreviousVersion, &l.EventID, &l.EventType, &l.Handler, &l.Topic,
			&l.Payload, &l.Metadata, &l.ParkedAt, &l.ReleaseAttempts, &l.LastError, &last, &next,
			&kind, &l.Reason, &l.CurrentVersion, &requested)
		l.Kind, l.Late, l.due = LateKind(kind), true, true
		if last != nil {
			l.LastAttemptAt = *last
		}
		if next != nil {
			l.NextAttemptAt = *next
		}
		if requested != nil {
			l.ApplyRequestedAt = *requested
		}
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("versioning: read late events: %w", err)
	}
	return out, nil
}

// RequestLateApply asks the group's running consumer to apply the given
// late events (`eventline parked apply-late`): its sweeper applies each on
// its next pass, in version order per aggregate, with the event marked
// late, and removes it from late_events (outcome late_applied). A request
// resets the event's failed attempts. It returns how many late events the
// ids named (an id held late in several aggregates, reused by a producer,
// names each of them); it needs only the database.
func (s *Store) RequestLateApply(ctx context.Context, db DBTX, group string, eventIDs ...string) (int, error) {
	if group == "" || len(eventIDs) == 0 {
		return 0, errors.New("versioning.RequestLateApply: the group and at least one event id are required")
	}
	tag, err := db.Exec(ctx, s.q.requestLate, group, eventIDs)
	if err != nil {
		return 0, fmt.Errorf("versioning: request late apply: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

// DiscardLate deletes the given late events of group for good (`eventline
// parked discard-late`); their processed_events outcome becomes
// late_discarded, so redeliveries stay duplicates. It returns how many were
// held (an id held late in several aggregates names each of them).
func (s *Store) DiscardLate(ctx context.Context, db DBTX, group string, eventIDs ...string) (int, error) {
	if group == "" || len(eventIDs) == 0 {
		return 0, errors.New("versioning.DiscardLate: the group and at least one event id are required")
	}
	var n int
	if err := db.QueryRow(ctx, s.q.discardLate, group, eventIDs).Scan(&n); err != nil {
		return 0, fmt.Errorf("versioning: discard late events: %w", err)
	}
	return n, nil
}

// CountLate returns how many events the group holds as late.
func (s *Store) CountLate(ctx context.Context, db DBTX, group string) (int64, error) {
	var n int64
	if err := db.QueryRow(ctx, s.q.countLate, group).Scan(&n); err != nil {
		return 0, fmt.Errorf("versioning: count late events of %q: %w", group, err)
	}
	return n, nil
}

// GroupsThatSkipped returns the consumer groups that recorded version of
// an aggregate in skipped_versions: an event with that version reaching
// them now is late (`eventline dlq replay` warns with it).
func (s *Store) GroupsThatSkipped(ctx context.Context, db DBTX, aggregateType, aggregateID string, version int64) ([]string, error) {
	rows, err := db.Query(ctx, s.q.groupsSkipped, aggregateType, aggregateID, version)
	if err != nil {
		return nil, fmt.Errorf("versioning: find groups that skipped %s/%s v%d: %w", aggregateType, aggregateID, version, err)
	}
	groups, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("versioning: find groups that skipped %s/%s v%d: %w", aggregateType, aggregateID, version, err)
	}
	return groups, nil
}

// applyLate applies an aggregate's late events whose apply an operator
// requested, in tx holding the aggregate's lock: each in a savepoint with
// p.Late set. A success removes the event (outcome late_applied); a
// failure is recorded with a backoff, and after opts.MaxAttempts failures
// (or a permanent one) the request is cleared: the event stays held with
// its last error for the operator.
func (s *Store) applyLate(ctx context.Context, tx pgx.Tx, k Key, opts ReleaseOptions, res *SweepResult) error {
	rows, err := tx.Query(ctx, s.q.lateOf, k.Group, k.AggregateType, k.AggregateID, drainLimit)
	if err != nil {
		return fmt.Errorf("versioning: load late events of %s: %w", k, err)
	}
	late, err := collectLate(rows)
	if err != nil {
		return err
	}
	for _, l := range late {
		herr, err := s.attempt(ctx, tx, l.Parked, opts.Apply, nil)
		if err != nil {
			return err
		}
		if herr == nil {
			if _, err := tx.Exec(ctx, s.q.doneLate, l.Group, l.EventID, l.AggregateType, l.AggregateID, string(dedup.OutcomeLateApplied)); err != nil {
				return fmt.Errorf("versioning: remove applied late event %s: %w", l.EventID, err)
			}
			res.LateApplied++
			continue
		}
		p := l.Parked
		p.ReleaseAttempts++
		p.LastError = herr.Error()
		res.LateFailed++
		if err := s.recordFailure(ctx, tx, s.q.failLate, p, opts.backoff(p.ReleaseAttempts)); err != nil {
			return err
		}
		if p.ReleaseAttempts >= opts.MaxAttempts || (opts.Permanent != nil && opts.Permanent(herr)) {
			if _, err := tx.Exec(ctx, s.q.giveUpLate, l.Group, l.EventID, l.AggregateType, l.AggregateID); err != nil {
				return fmt.Errorf("versioning: clear the apply request of late event %s: %w", l.EventID, err)
			}
		}
	}
	return nil
}
