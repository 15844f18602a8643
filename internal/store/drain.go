package store

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/versioning"
)

var (
	deleteParkedSQL = statement(`DELETE FROM {schema}.parked_events WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4`)
	// ($1 group, $2 event id, $3 type, $4 id)
	forgetSQL = statement(`DELETE FROM {schema}.processed_events WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $3 AND aggregate_id = $4`)
	// ($1 group, $2 type, $3 id, $4 version, $5 event id, $6 error,
	// $7 backoff in microseconds, $8 attempts)
	failParkedSQL = statement(`UPDATE {schema}.parked_events SET release_attempts = $8, last_error = $6, last_attempt_at = now(),
			next_attempt_at = now() + $7::bigint * interval '1 microsecond'
		WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_version = $4 AND event_id = $5`)
)

// ApplyFunc applies one parked or late event whose turn has come. tx is a
// savepoint inside the transaction holding the aggregate's lock: the
// function writes its effects through tx and must neither commit nor roll
// it back. An error (or a panic) rolls back to the savepoint and leaves the
// event where it was, with the failure recorded (release_attempts,
// last_error, next_attempt_at). p.Late is true for a late event.
type ApplyFunc func(ctx context.Context, tx pgx.Tx, p Parked) error

// ReleaseOptions say how parked events are applied, by [Store.Drain] and by
// the [Sweeper]. Every field is required but Permanent: the middleware
// fills them from its Config.
type ReleaseOptions struct {
	// Apply applies an event.
	Apply ApplyFunc
	// MaxAttempts is how many failed attempts to apply a parked event are
	// allowed before it is given up: its version recorded as skipped and
	// the event held as late (held_events, HoldFailed).
	MaxAttempts int
	// Backoff is the wait between failed attempts before the sweeper
	// tries again.
	Backoff eventline.Backoff
	// Permanent, when set, reports errors that retrying cannot fix (the
	// event does not decode, its payload does not fit the handler): the
	// event is given up at once.
	Permanent func(error) bool
}

// drainLimit bounds the parked events one drain loads.
const drainLimit = 1000

// DrainResult reports one drain of an aggregate's parked events.
type DrainResult struct {
	// Version is the aggregate's version after the drain.
	Version int64
	// Released are the parked events applied, in order.
	Released []Parked
	// Late counts parked events held as late because the
	// aggregate had passed their version.
	Late int
	// GapsSkipped counts the gaps given up on after the park timeout;
	// VersionsSkipped the versions recorded as skipped, theirs and those
	// of the events given up.
	GapsSkipped     int
	VersionsSkipped int64 // see GapsSkipped
	// DeadLettered are the parked events given up (see HoldFailed).
	DeadLettered []Parked
	// Failed is the parked event whose apply failed, if any; draining
	// stopped there and it stays parked. FailErr is its error.
	Failed  *Parked
	FailErr error // see Failed
	// Remaining counts the events still parked after the drain (at most
	// the number loaded).
	Remaining int
	// GapsClosed are the gaps in front of parked events that closed: the
	// one the arriving event filled (Drain), or those the sweeper skipped
	// or applied after an operator's release.
	GapsClosed []ClosedGap
}

// Drain applies an aggregate's parked events whose predecessor has been
// applied, in version order, each through opts.Apply in its own savepoint,
// in tx. tx must hold the aggregate's lock and current must be its version
// (as after [Store.Admit] returned Next or Jump). Parked events at or below
// current are held as late. Draining stops at the next gap, at an
// event waiting for its release backoff, or at the first event whose apply
// fails: that savepoint is rolled back, the failure is recorded on the
// parked row, and the rest stays parked for the sweeper, unless the event
// has now failed opts.MaxAttempts times (or permanently): then it is given
// up (held as late, see HoldFailed) and draining goes on past it. Each released event
// leaves parked_events and its dedup outcome becomes applied; the
// aggregate's version and parked count are updated.
//
// The error is non-nil only when tx itself failed; then the caller must
// roll back.
func (s *Store) Drain(ctx context.Context, tx pgx.Tx, k Key, current int64, opts ReleaseOptions) (DrainResult, error) {
	return s.drain(ctx, tx, k, current, opts, 0)
}

// drain is Drain with a park timeout: when it is positive (the sweeper),
// the gap in front of a parked event is given up when any event from it on
// has waited longer.
func (s *Store) drain(ctx context.Context, tx pgx.Tx, k Key, current int64, opts ReleaseOptions, parkTimeout time.Duration) (DrainResult, error) {
	res := DrainResult{Version: current}
	parked, err := s.parkedOf(ctx, tx, k, parkTimeout)
	if err != nil {
		return res, err
	}
	delta := 0
	i := 0
	sweeping, head := parkTimeout > 0, true
	var released *ClosedGap // the head's gap, released by an operator
	for ; i < len(parked); i++ {
		p := parked[i]
		if p.Version <= res.Version {
			if err := s.passParked(ctx, tx, p, res.Version); err != nil {
				return res, err
			}
			res.Late++
			delta--
			continue
		}
		if head {
			// The lowest parked event: when Drain runs after its
			// predecessor arrived, that arrival filled its gap; when the
			// sweeper finds it ready, an operator may have released it.
			head = false
			switch {
			case !sweeping && p.PreviousVersion == current:
				res.GapsClosed = append(res.GapsClosed, ClosedGap{Key: k, Outcome: GapFilled, Open: gapOpen(parked[i:], time.Now())})
			case sweeping && p.due && p.PreviousVersion == res.Version:
				at, ok, err := s.releasedAt(ctx, tx, k, p.PreviousVersion)
				if err != nil {
					return res, err
				}
				if ok {
					released = &ClosedGap{Key: k, Outcome: GapReleased, Open: gapOpen(parked[i:], at)}
				}
			}
		}
		if !p.due {
			break
		}
		var skipFrom, skipTo int64
		var pre func(pgx.Tx) error
		if p.PreviousVersion > res.Version {
			if parkTimeout <= 0 || !slices.ContainsFunc(parked[i:], func(p Parked) bool { return p.expired }) {
				break
			}
			skipFrom, skipTo = res.Version+1, p.PreviousVersion
			reason := fmt.Sprintf("park timeout: %s waited over %s for the missing versions", p.describe(), parkTimeout)
			pre = func(sp pgx.Tx) error { return s.RecordSkipped(ctx, sp, k, skipFrom, skipTo, reason) }
		}
		herr, err := s.attempt(ctx, tx, p, opts.Apply, pre)
		if err != nil {
			return res, err
		}
		if herr == nil {
			if _, err := tx.Exec(ctx, s.q(deleteParkedSQL), p.Group, p.AggregateType, p.AggregateID, p.Version); err != nil {
				return res, fmt.Errorf("eventline: remove parked event %s: %w", p.EventID, err)
			}
			if _, err := tx.Exec(ctx, s.q(setOutcomeSQL), p.Group, p.EventID, p.AggregateType, p.AggregateID, string(dedup.OutcomeApplied)); err != nil {
				return res, fmt.Errorf("eventline: set the outcome of released event %s: %w", p.EventID, err)
			}
			if pre != nil {
				res.GapsSkipped++
				res.VersionsSkipped += skipTo - skipFrom + 1
				res.GapsClosed = append(res.GapsClosed, ClosedGap{Key: k, Outcome: GapSkipped, Open: gapOpen(parked[i:], time.Now())})
			}
			if released != nil {
				res.GapsClosed = append(res.GapsClosed, *released)
				released = nil
			}
			delta--
			res.Released = append(res.Released, p)
			res.Version = p.Version
			continue
		}
		failed := p
		failed.ReleaseAttempts++
		failed.LastError = herr.Error()
		res.Failed, res.FailErr = &failed, herr
		if failed.ReleaseAttempts < opts.MaxAttempts && (opts.Permanent == nil || !opts.Permanent(herr)) {
			if err := s.recordFailure(ctx, tx, failed, opts.Backoff); err != nil {
				return res, err
			}
			break
		}
		gaveUp, err := s.giveUp(ctx, tx, k, res.Version, failed, herr, opts)
		if err != nil {
			return res, err
		}
		if !gaveUp {
			break
		}
		res.Failed, res.FailErr = nil, nil
		res.DeadLettered = append(res.DeadLettered, failed)
		res.VersionsSkipped += p.Version - res.Version
		res.Version = p.Version
		delta--
	}
	res.Remaining = len(parked) - i
	if delta != 0 || res.Version != current {
		if err := s.setVersion(ctx, tx, k, res.Version, delta); err != nil {
			return res, err
		}
	}
	return res, nil
}

// giveUp gives up a parked event that failed for good, in a savepoint: its
// parked row and dedup record go, versions current+1..p.Version are
// recorded as skipped, and HoldFailed holds it for the operator. When that
// fails, the savepoint is rolled back, the failure is recorded with a
// backoff as for any failed attempt, and gaveUp is false.
func (s *Store) giveUp(ctx context.Context, tx pgx.Tx, k Key, current int64, p Parked, herr error, opts ReleaseOptions) (gaveUp bool, err error) {
	reason := fmt.Sprintf("gave up on parked %s after %d failed release attempts: %v", p.describe(), p.ReleaseAttempts, herr)
	if opts.Permanent != nil && opts.Permanent(herr) {
		reason = fmt.Sprintf("gave up on parked %s: it can never be applied: %v", p.describe(), herr)
	}
	derr, err := s.attempt(ctx, tx, p, func(ctx context.Context, sp pgx.Tx, p Parked) error {
		if _, err := sp.Exec(ctx, s.q(deleteParkedSQL), p.Group, p.AggregateType, p.AggregateID, p.Version); err != nil {
			return err
		}
		if _, err := sp.Exec(ctx, s.q(forgetSQL), p.Group, p.EventID, p.AggregateType, p.AggregateID); err != nil {
			return err
		}
		if err := s.RecordSkipped(ctx, sp, k, current+1, p.Version, reason); err != nil {
			return err
		}
		return s.HoldFailed(ctx, sp, p, reason)
	}, nil)
	if err != nil || derr == nil {
		return err == nil, err
	}
	p.LastError = fmt.Sprintf("%s; and it could not be dead-lettered: %v", p.LastError, derr)
	return false, s.recordFailure(ctx, tx, p, opts.Backoff)
}

// attempt runs pre (when set) and apply for p in a savepoint. herr is the
// apply's failure (the savepoint was rolled back); err reports a broken
// transaction.
func (s *Store) attempt(ctx context.Context, tx pgx.Tx, p Parked, apply ApplyFunc, pre func(pgx.Tx) error) (herr, err error) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("eventline: savepoint for %s: %w", p.describe(), err)
	}
	if pre != nil {
		if err := pre(sp); err != nil {
			_ = sp.Rollback(ctx)
			return nil, err
		}
	}
	herr = callApply(ctx, sp, p, apply)
	if herr == nil {
		if err := sp.Commit(ctx); err != nil {
			return nil, fmt.Errorf("eventline: release savepoint of %s: %w", p.describe(), err)
		}
		return nil, nil
	}
	if err := sp.Rollback(ctx); err != nil {
		return nil, fmt.Errorf("eventline: roll back %s after it failed: %w", p.describe(), errors.Join(herr, err))
	}
	return herr, nil
}

// recordFailure writes p's failure count, last error and next attempt time
// (after b's wait for that many failures) on its parked row.
func (s *Store) recordFailure(ctx context.Context, tx DBTX, p Parked, b eventline.Backoff) error {
	wait := backoff.Jittered(b, p.ReleaseAttempts)
	if _, err := tx.Exec(ctx, s.q(failParkedSQL), p.Group, p.AggregateType, p.AggregateID, p.Version, p.EventID, p.LastError, wait.Microseconds(), p.ReleaseAttempts); err != nil {
		return fmt.Errorf("eventline: record failed release of %s: %w", p.describe(), err)
	}
	return nil
}

func callApply(ctx context.Context, tx pgx.Tx, p Parked, apply ApplyFunc) (err error) {
	if apply == nil {
		return fmt.Errorf("%w: %s (handler %q)", versioning.ErrNoHandler, p.EventID, p.Handler)
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic while applying %s: %v\n%s", p.describe(), r, debug.Stack())
		}
	}()
	return apply(ctx, tx, p)
}
