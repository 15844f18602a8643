package store

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

// lateCols are the columns collectLate scans.
const lateCols = `consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type, handler, topic,
	payload, metadata, held_at, attempts, coalesce(last_error, ''), last_attempt_at, next_attempt_at,
	kind, reason, current_version, apply_requested_at`

var (
	// A parked event whose version the aggregate ($6 = current
	// version) has passed moves to late_events, with the reason of
	// the skip that covers its version, or $5.
	passParkedSQL = statement(`WITH sk AS (
			SELECT reason FROM {schema}.skipped_versions WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
				AND $4::bigint BETWEEN from_version AND to_version ORDER BY id DESC LIMIT 1
		), moved AS (
			DELETE FROM {schema}.parked_events WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4::bigint
			RETURNING *
		), held AS (
			INSERT INTO {schema}.late_events (consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, previous_version,
				event_type, handler, topic, payload, metadata, kind, reason, current_version)
			SELECT m.consumer_group, m.event_id, m.aggregate_type, m.aggregate_id, m.aggregate_version, m.previous_version,
				m.event_type, m.handler, m.topic, m.payload, m.metadata,
				CASE WHEN EXISTS (SELECT 1 FROM sk) THEN 'arrived_late' ELSE 'passed' END, coalesce((SELECT reason FROM sk), $5), $6::bigint
			FROM moved m ON CONFLICT DO NOTHING
		)
		UPDATE {schema}.processed_events SET outcome = 'late'
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND event_id IN (SELECT event_id FROM moved)`)
	// A stale event ($4 version <= current) whose version is in
	// skipped_versions is late: with $13 it is held in late_events;
	// its dedup outcome becomes $14 (late, or late_applied when the
	// caller applies it now), else stale. Returns the skip's reason,
	// NULL when the event is merely stale. ($1 group, $2 type, $3 id,
	// $5 previous version, $6 event id, $7 event type, $8 handler,
	// $9 topic, $10 payload, $11 metadata, $12 current version)
	holdLateSQL = statement(`WITH sk AS (
			SELECT reason FROM {schema}.skipped_versions WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
				AND $4::bigint BETWEEN from_version AND to_version ORDER BY id DESC LIMIT 1
		), held AS (
			INSERT INTO {schema}.late_events (consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, previous_version,
				event_type, handler, topic, payload, metadata, kind, reason, current_version)
			SELECT $1, $6, $2, $3, $4::bigint, $5::bigint, $7, $8, $9, $10, $11, 'arrived_late', sk.reason, $12::bigint
			FROM sk WHERE $13::boolean ON CONFLICT DO NOTHING RETURNING 1
		), outcome AS (
			UPDATE {schema}.processed_events SET outcome = CASE WHEN EXISTS (SELECT 1 FROM sk) THEN $14::text ELSE 'stale' END
			WHERE consumer_group = $1 AND event_id = $6 AND aggregate_type = $2 AND aggregate_id = $3
		)
		SELECT (SELECT reason FROM sk)`)
	// A stale event that is not late, held as a version conflict
	// ($1..$12 as for holdLate, $13 the reason); its dedup outcome
	// becomes late.
	holdConflictSQL = statement(`WITH held AS (
			INSERT INTO {schema}.late_events (consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, previous_version,
				event_type, handler, topic, payload, metadata, kind, reason, current_version)
			VALUES ($1, $6, $2, $3, $4::bigint, $5::bigint, $7, $8, $9, $10, $11, 'passed', $13, $12::bigint)
			ON CONFLICT DO NOTHING
		)
		UPDATE {schema}.processed_events SET outcome = 'late' WHERE consumer_group = $1 AND event_id = $6 AND aggregate_type = $2 AND aggregate_id = $3`)
	// ($1 group, $2 type, $3 id, $4 version, $5 event id to leave out)
	appliedBySQL = statement(`SELECT event_id FROM {schema}.processed_events
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4::bigint
			AND event_id <> $5 AND outcome IN ('applied', 'late_applied')
		ORDER BY processed_at LIMIT 1`)
	// The default dead letter: the given-up parked event joins the
	// late events, and its dedup record says late again.
	holdFailedSQL = statement(`WITH held AS (
			INSERT INTO {schema}.late_events (consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, previous_version,
				event_type, handler, topic, payload, metadata, kind, reason, current_version,
				attempts, last_error, last_attempt_at)
			VALUES ($1, $2, $3, $4, $5::bigint, $6::bigint, $7, $8, $9, $10, $11, 'release_failed', $12, $13::bigint, $14, $15, now())
			ON CONFLICT DO NOTHING
		)
		INSERT INTO {schema}.processed_events (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
		VALUES ($1, $2, $7, $3, $4, $5::bigint, 'late')
		ON CONFLICT (consumer_group, event_id, aggregate_type, aggregate_id) DO UPDATE SET outcome = 'late'`)
	lateOfSQL = statement(`SELECT ` + lateCols + ` FROM {schema}.late_events
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
			AND apply_requested_at IS NOT NULL AND (next_attempt_at IS NULL OR next_attempt_at <= now())
		ORDER BY aggregate_version, held_at LIMIT $4 FOR UPDATE`)
	failLateSQL = statement(`UPDATE {schema}.late_events SET attempts = $8, last_error = $6, last_attempt_at = now(),
			next_attempt_at = now() + $7::bigint * interval '1 microsecond'
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4 AND event_id = $5`)
	// doneLate and giveUpLate: ($1 group, $2 event id, $3 type, $4
	// id), doneLate's outcome $5.
	doneLateSQL = statement(`WITH gone AS (DELETE FROM {schema}.late_events WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $3 AND aggregate_id = $4 RETURNING event_id)
		UPDATE {schema}.processed_events SET outcome = $5 WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $3 AND aggregate_id = $4 AND EXISTS (SELECT 1 FROM gone)`)
	giveUpLateSQL  = statement(`UPDATE {schema}.late_events SET apply_requested_at = NULL WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $3 AND aggregate_id = $4`)
	requestLateSQL = statement(`UPDATE {schema}.late_events SET apply_requested_at = now(), attempts = 0, next_attempt_at = NULL
		WHERE consumer_group = $1 AND event_id = ANY($2::text[])`)
	discardLateSQL = statement(`WITH gone AS (DELETE FROM {schema}.late_events WHERE consumer_group = $1 AND event_id = ANY($2::text[])
			RETURNING event_id, aggregate_type, aggregate_id),
		o AS (UPDATE {schema}.processed_events p SET outcome = 'late_discarded' FROM gone g
			WHERE p.consumer_group = $1 AND p.event_id = g.event_id AND p.aggregate_type = g.aggregate_type AND p.aggregate_id = g.aggregate_id)
		SELECT count(*) FROM gone`)
	listLateSQL = statement(`SELECT ` + lateCols + ` FROM {schema}.late_events
		WHERE ($1 = '' OR consumer_group = $1) AND ($2 = '' OR aggregate_type = $2) AND ($3 = '' OR aggregate_id = $3)
		ORDER BY consumer_group, aggregate_type, aggregate_id, aggregate_version, held_at LIMIT $4`)
	countLateSQL     = statement(`SELECT count(*) FROM {schema}.late_events WHERE consumer_group = $1`)
	groupsSkippedSQL = statement(`SELECT DISTINCT consumer_group FROM {schema}.skipped_versions
		WHERE aggregate_type = $1 AND aggregate_id = $2 AND $3::bigint BETWEEN from_version AND to_version ORDER BY consumer_group`)
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
	// gate holds it here (HoldFailed), its version recorded as
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
	err = tx.QueryRow(ctx, s.q(holdLateSQL), r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, e.ID, e.Type,
		r.Handler, r.Topic, payload, md, r.Current, r.Hold, string(outcome)).Scan(&why)
	if err != nil {
		return false, "", contentError(fmt.Errorf("eventline: settle stale event %s: %w", e.ID, err))
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
	_, err = tx.Exec(ctx, s.q(holdConflictSQL), r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, e.ID, e.Type,
		r.Handler, r.Topic, payload, md, r.Current, reason)
	if err != nil {
		return "", contentError(fmt.Errorf("eventline: hold conflicting event %s: %w", e.ID, err))
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
	err = db.QueryRow(ctx, s.q(appliedBySQL), k.Group, k.AggregateType, k.AggregateID, version, exceptID).Scan(&eventID)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("eventline: find the event that applied %s v%d: %w", k, version, err)
	}
	return eventID, true, nil
}

// HoldFailed keeps a parked event the gate gave up on in late_events
// (kind release_failed) with reason, and records its dedup outcome as
// late, so redeliveries are duplicates while an operator decides
// (`eventline parked late`, `apply-late`, `discard-late`).
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
	_, err = tx.Exec(ctx, s.q(holdFailedSQL), p.Group, p.EventID, p.AggregateType, p.AggregateID, p.Version, p.PreviousVersion,
		p.EventType, p.Handler, p.Topic, payload, md, reason, current, p.ReleaseAttempts, p.LastError)
	if err != nil {
		return fmt.Errorf("eventline: hold given-up event %s in late_events: %w", p.EventID, err)
	}
	return nil
}

// passParked moves a parked event whose version the aggregate has passed
// (current) to late_events.
func (s *Store) passParked(ctx context.Context, tx pgx.Tx, p Parked, current int64) error {
	reason := fmt.Sprintf("the aggregate reached v%d without applying %s: another event claimed its version, or a successor declared an earlier predecessor", current, p.describe())
	if _, err := tx.Exec(ctx, s.q(passParkedSQL), p.Group, p.AggregateType, p.AggregateID, p.Version, reason, current); err != nil {
		return fmt.Errorf("eventline: move passed parked event %s to late_events: %w", p.EventID, err)
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
	rows, err := db.Query(ctx, s.q(listLateSQL), f.Group, f.AggregateType, f.AggregateID, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("eventline: list late events: %w", err)
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
		return nil, fmt.Errorf("eventline: read late events: %w", err)
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
	tag, err := db.Exec(ctx, s.q(requestLateSQL), group, eventIDs)
	if err != nil {
		return 0, fmt.Errorf("eventline: request late apply: %w", err)
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
	if err := db.QueryRow(ctx, s.q(discardLateSQL), group, eventIDs).Scan(&n); err != nil {
		return 0, fmt.Errorf("eventline: discard late events: %w", err)
	}
	return n, nil
}

// CountLate returns how many events the group holds as late.
func (s *Store) CountLate(ctx context.Context, db DBTX, group string) (int64, error) {
	var n int64
	if err := db.QueryRow(ctx, s.q(countLateSQL), group).Scan(&n); err != nil {
		return 0, fmt.Errorf("eventline: count late events of %q: %w", group, err)
	}
	return n, nil
}

// GroupsThatSkipped returns the consumer groups that recorded version of
// an aggregate in skipped_versions: an event with that version reaching
// them now is late (`eventline dlq replay` warns with it).
func (s *Store) GroupsThatSkipped(ctx context.Context, db DBTX, aggregateType, aggregateID string, version int64) ([]string, error) {
	rows, err := db.Query(ctx, s.q(groupsSkippedSQL), aggregateType, aggregateID, version)
	if err != nil {
		return nil, fmt.Errorf("eventline: find groups that skipped %s/%s v%d: %w", aggregateType, aggregateID, version, err)
	}
	groups, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("eventline: find groups that skipped %s/%s v%d: %w", aggregateType, aggregateID, version, err)
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
	rows, err := tx.Query(ctx, s.q(lateOfSQL), k.Group, k.AggregateType, k.AggregateID, drainLimit)
	if err != nil {
		return fmt.Errorf("eventline: load late events of %s: %w", k, err)
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
			if _, err := tx.Exec(ctx, s.q(doneLateSQL), l.Group, l.EventID, l.AggregateType, l.AggregateID, string(dedup.OutcomeLateApplied)); err != nil {
				return fmt.Errorf("eventline: remove applied late event %s: %w", l.EventID, err)
			}
			res.LateApplied++
			continue
		}
		p := l.Parked
		p.ReleaseAttempts++
		p.LastError = herr.Error()
		res.LateFailed++
		if err := s.recordFailure(ctx, tx, s.q(failLateSQL), p, opts.backoff(p.ReleaseAttempts)); err != nil {
			return err
		}
		if p.ReleaseAttempts >= opts.MaxAttempts || (opts.Permanent != nil && opts.Permanent(herr)) {
			if _, err := tx.Exec(ctx, s.q(giveUpLateSQL), l.Group, l.EventID, l.AggregateType, l.AggregateID); err != nil {
				return fmt.Errorf("eventline: clear the apply request of late event %s: %w", l.EventID, err)
			}
		}
	}
	return nil
}
