package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/held"
)

// heldLateCols are the columns of held_events a late event fills: $1
// group, $2 type, $3 id, $4 version, $5 previous version, $6 event id, $7
// event type, $8 handler, $9 topic, $10 payload, $11 and $12 the header
// keys and values (held.Headers), $13 the aggregate's version; the
// message uuid is the event id, as for parked events.
const heldLateCols = `kind, consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type,
	handler, topic, message_uuid, payload, header_keys, header_values, current_version, cause, reason`

// heldLateValues are heldLateCols' values but the cause and reason.
const heldLateValues = `'late', $1, $2, $3, $4::bigint, $5::bigint, $6, $7, $8, $9, convert_to($6, 'UTF8'), $10, $11, $12, $13::bigint`

var (
	// A parked event whose version the aggregate ($6 = current
	// version) has passed is held as late, with the reason of the
	// skip that covers its version, or $5; its metadata becomes the
	// header columns.
	passParkedSQL = statement(`WITH sk AS (
			SELECT reason FROM {schema}.skipped_versions WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
				AND $4::bigint BETWEEN from_version AND to_version ORDER BY id DESC LIMIT 1
		), moved AS (
			DELETE FROM {schema}.parked_events WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4::bigint
			RETURNING *
		), held AS (
			INSERT INTO {schema}.held_events (` + heldLateCols + `)
			SELECT 'late', m.consumer_group, m.aggregate_type, m.aggregate_id, m.aggregate_version, m.previous_version, m.event_id, m.event_type,
				m.handler, m.topic, convert_to(m.event_id, 'UTF8'), m.payload,
				coalesce((SELECT array_agg(convert_to(k, 'UTF8') ORDER BY k COLLATE "C") FROM jsonb_object_keys(m.metadata) k), '{}'),
				coalesce((SELECT array_agg(convert_to(m.metadata->>k, 'UTF8') ORDER BY k COLLATE "C") FROM jsonb_object_keys(m.metadata) k), '{}'),
				$6::bigint, CASE WHEN EXISTS (SELECT 1 FROM sk) THEN 'arrived_late' ELSE 'passed' END, coalesce((SELECT reason FROM sk), $5)
			FROM moved m ON CONFLICT DO NOTHING
		)
		UPDATE {schema}.processed_events SET outcome = 'late'
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND event_id IN (SELECT event_id FROM moved)`)
	// A stale event ($4 version <= current) whose version is in
	// skipped_versions is late: with $14 it is held (cause
	// arrived_late, the skip's reason), in the statement that finds it
	// late; its dedup outcome becomes $15 (late, or late_applied when
	// the caller applies it now), else stale. Returns the skip's
	// reason, NULL when the event is merely stale. ($1..$13 as
	// heldLateCols says.)
	holdLateSQL = statement(`WITH sk AS (
			SELECT reason FROM {schema}.skipped_versions WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3
				AND $4::bigint BETWEEN from_version AND to_version ORDER BY id DESC LIMIT 1
		), held AS (
			INSERT INTO {schema}.held_events (` + heldLateCols + `)
			SELECT ` + heldLateValues + `, 'arrived_late', sk.reason
			FROM sk WHERE $14::boolean ON CONFLICT DO NOTHING RETURNING 1
		), outcome AS (
			UPDATE {schema}.processed_events SET outcome = CASE WHEN EXISTS (SELECT 1 FROM sk) THEN $15::text ELSE 'stale' END
			WHERE consumer_group = $1 AND event_id = $6 AND aggregate_type = $2 AND aggregate_id = $3
		)
		SELECT (SELECT reason FROM sk)`)
	// A stale event that is not late, held as a version conflict
	// ($1..$13 as for holdLate, $14 the reason); its dedup outcome
	// becomes late.
	holdConflictSQL = statement(`WITH held AS (
			INSERT INTO {schema}.held_events (` + heldLateCols + `)
			VALUES (` + heldLateValues + `, 'version_conflict', $14)
			ON CONFLICT DO NOTHING
		)
		UPDATE {schema}.processed_events SET outcome = 'late' WHERE consumer_group = $1 AND event_id = $6 AND aggregate_type = $2 AND aggregate_id = $3`)
	// The first event but $5 that group $1 recorded as applying (in
	// order or late) version $4 of aggregate $2/$3. It filters the
	// group's records by aggregate, so it belongs on rare paths: an index
	// that leads with the aggregate makes it a range scan over that
	// aggregate's records, without one it reads the group's.
	appliedBySQL = statement(`SELECT event_id FROM {schema}.processed_events
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4::bigint
			AND event_id <> $5 AND outcome IN ('applied', 'late_applied')
		ORDER BY processed_at LIMIT 1`)
	// The default dead letter: the given-up parked event is held as
	// late ($1..$13 as for holdLate, $14 the reason, $15 its release
	// attempts, $16 the last error), and its dedup record says late
	// again.
	holdFailedSQL = statement(`WITH held AS (
			INSERT INTO {schema}.held_events (` + heldLateCols + `, attempts, last_error, last_attempt_at)
			VALUES (` + heldLateValues + `, 'release_failed', $14, $15, $16, now())
			ON CONFLICT DO NOTHING
		)
		INSERT INTO {schema}.processed_events (consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome)
		VALUES ($1, $6, $7, $2, $3, $4::bigint, 'late')
		ON CONFLICT (consumer_group, event_id, aggregate_type, aggregate_id) DO UPDATE SET outcome = 'late'`)
)

// heldArgs returns r's event, with PreviousVersion set to Follows, and
// the values of heldLateCols but the cause and reason ($1..$13). An event
// whose metadata cannot be stored byte-exact is refused with an
// *eventline.InvalidEventError.
func (r LateRequest) heldArgs() (eventline.Event, []any, error) {
	e, payload, md, err := r.stored()
	if err != nil {
		return e, nil, err
	}
	hk, hv := held.Headers(md)
	return e, []any{r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.PreviousVersion, e.ID, e.Type,
		r.Handler, r.Topic, payload, hk, hv, r.Current}, nil
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
	e, args, err := r.heldArgs()
	if err != nil {
		return false, "", err
	}
	outcome := dedup.OutcomeLate
	if !r.Hold {
		outcome = dedup.OutcomeLateApplied
	}
	var why *string
	if err := tx.QueryRow(ctx, s.q(holdLateSQL), append(args, r.Hold, string(outcome))...).Scan(&why); err != nil {
		return false, "", contentError(fmt.Errorf("eventline: settle stale event %s: %w", e.ID, err))
	}
	if why == nil {
		return false, "", nil
	}
	return true, *why, nil
}

// HoldConflict holds a stale event that is not late (Admit returned Stale
// and HoldLate found its version was not given up on) for the operator, in
// tx, which holds the aggregate's lock: held_events, kind late, cause
// version_conflict; its dedup outcome late. Its reason names the first
// other event recorded in processed_events as applying the version (in
// order or late), or says none is recorded (a successor declared an
// earlier predecessor, or the record of the event that applied it
// expired). The gate calls it for a replayed dead letter, which is an
// event that was never applied: a stale verdict means its version was
// taken while it was dead, which an operator must settle (apply it late,
// or discard it), not a duplicate to drop.
//
// An event whose metadata cannot be stored byte-exact is refused with an
// *eventline.InvalidEventError, before anything is written.
func (s *Store) HoldConflict(ctx context.Context, tx DBTX, r LateRequest) (reason string, err error) {
	e, args, err := r.heldArgs()
	if err != nil {
		return "", err
	}
	var by string
	err = tx.QueryRow(ctx, s.q(appliedBySQL), r.Group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.ID).Scan(&by)
	switch {
	case err == nil:
		reason = fmt.Sprintf("version %d was applied by event %s", e.AggregateVersion, by)
	case !errors.Is(err, pgx.ErrNoRows):
		k := Key{Group: r.Group, AggregateType: e.AggregateType, AggregateID: e.AggregateID}
		return "", fmt.Errorf("eventline: find the event that applied %s v%d: %w", k, e.AggregateVersion, err)
	default:
		reason = fmt.Sprintf("the aggregate passed version %d without this event (it is at v%d), and no other event is recorded as applying it: "+
			"a later event declared an earlier predecessor, or the record of the event that applied it (this one, maybe) expired",
			e.AggregateVersion, r.Current)
	}
	if _, err := tx.Exec(ctx, s.q(holdConflictSQL), append(args, reason)...); err != nil {
		return "", contentError(fmt.Errorf("eventline: hold conflicting event %s: %w", e.ID, err))
	}
	return reason, nil
}

// HoldFailed holds a parked event the gate gave up on for the operator (held_events: kind late, cause
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
	_, err = tx.Exec(ctx, s.q(holdFailedSQL), p.Group, p.AggregateType, p.AggregateID, p.Version, p.PreviousVersion, p.EventID,
		p.EventType, p.Handler, p.Topic, payload, hk, hv, current, reason, p.ReleaseAttempts, p.LastError)
	if err != nil {
		return fmt.Errorf("eventline: hold given-up event %s: %w", p.EventID, err)
	}
	return nil
}

// passParked holds a parked event whose version the aggregate has passed
// (current) as late.
func (s *Store) passParked(ctx context.Context, tx pgx.Tx, p Parked, current int64) error {
	reason := fmt.Sprintf("the aggregate reached v%d without applying %s: another event claimed its version, or a successor declared an earlier predecessor", current, p.describe())
	if _, err := tx.Exec(ctx, s.q(passParkedSQL), p.Group, p.AggregateType, p.AggregateID, p.Version, reason, current); err != nil {
		return fmt.Errorf("eventline: hold passed parked event %s as late: %w", p.EventID, err)
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
		return fmt.Errorf("eventline: %w", err)
	}
	for _, l := range late {
		p := lateParked(l)
		herr, err := s.attempt(ctx, tx, p, opts.Apply, nil)
		if err != nil {
			return err
		}
		if herr == nil {
			if err := s.held.MarkLateApplied(ctx, tx, l.ID); err != nil {
				return fmt.Errorf("eventline: %w", err)
			}
			res.LateApplied++
			continue
		}
		res.LateFailed++
		attempts := l.Attempts + 1
		giveUp := attempts >= opts.MaxAttempts || (opts.Permanent != nil && opts.Permanent(herr))
		if err := s.held.MarkReplayFailed(ctx, tx, l.ID, herr.Error(), backoff.Jittered(opts.Backoff, attempts), giveUp); err != nil {
			return fmt.Errorf("eventline: %w", err)
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
