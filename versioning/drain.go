package versioning

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/jackc/pgx/v5"

	"github.com/eventline/eventline/dedup"
)

// ApplyFunc applies one parked event whose turn has come. tx is a savepoint
// inside the transaction holding the aggregate's lock: the function writes
// its effects through tx and must neither commit nor roll it back. An error
// (or a panic) rolls back to the savepoint and leaves the event parked, with
// the failure recorded in release_attempts and last_error.
type ApplyFunc func(ctx context.Context, tx pgx.Tx, p Parked) error

// drainLimit bounds the parked events one drain loads.
const drainLimit = 1000

// DrainResult reports one drain of an aggregate's parked events.
type DrainResult struct {
	// Version is the aggregate's version after the drain.
	Version int64
	// Released are the parked events applied, in order.
	Released []Parked
	// Stale counts parked events discarded because the aggregate had
	// already passed their version.
	Stale int
	// Failed is the parked event whose handler failed, if any; draining
	// stopped there. FailErr is its error.
	Failed  *Parked
	FailErr error // see Failed
	// Remaining counts the events still parked after the drain (at most
	// the number loaded).
	Remaining int
}

// Drain applies an aggregate's parked events that are next in line, in
// version order, each through apply in its own savepoint, in tx. tx must
// hold the aggregate's lock and current must be its version (as after
// [Store.Admit] returned Next or Jump). Parked events at or below current
// are discarded as stale. Draining stops at the next gap or at the first
// event whose apply fails: that savepoint is rolled back, the failure is
// recorded on the parked row, and the rest stays parked for the sweeper.
// Each released event leaves parked_events and its dedup outcome becomes
// applied; the aggregate's version and parked count are updated.
//
// The error is non-nil only when tx itself failed; then the caller must
// roll back.
func (s *Store) Drain(ctx context.Context, tx pgx.Tx, k Key, current int64, apply ApplyFunc) (DrainResult, error) {
	parked, err := s.parkedOf(ctx, tx, k, 0, drainLimit)
	if err != nil {
		return DrainResult{Version: current}, err
	}
	res, _, err := s.drainList(ctx, tx, k, current, parked, apply)
	return res, err
}

// drainList is Drain over already loaded parked events (in version order).
// It returns the events left parked.
func (s *Store) drainList(ctx context.Context, tx pgx.Tx, k Key, current int64, parked []Parked, apply ApplyFunc) (DrainResult, []Parked, error) {
	res := DrainResult{Version: current}
	delta := 0
	i := 0
	for ; i < len(parked); i++ {
		p := parked[i]
		if p.Version <= res.Version {
			if err := s.removeParked(ctx, tx, p, dedup.OutcomeStale); err != nil {
				return res, nil, err
			}
			res.Stale++
			delta--
			continue
		}
		if p.Version != res.Version+1 {
			break
		}
		ok, err := s.applyParked(ctx, tx, p, apply, &res)
		if err != nil {
			return res, nil, err
		}
		if !ok {
			break
		}
		if err := s.removeParked(ctx, tx, p, dedup.OutcomeApplied); err != nil {
			return res, nil, err
		}
		delta--
		res.Released = append(res.Released, p)
		res.Version = p.Version
	}
	rest := parked[i:]
	res.Remaining = len(rest)
	if delta != 0 || res.Version != current {
		if err := s.setVersion(ctx, tx, k, res.Version, delta); err != nil {
			return res, nil, err
		}
	}
	return res, rest, nil
}

// applyParked runs apply for p in a savepoint. ok is false when apply
// failed (recorded on the parked row and in res); err only reports a broken
// transaction.
func (s *Store) applyParked(ctx context.Context, tx pgx.Tx, p Parked, apply ApplyFunc, res *DrainResult) (ok bool, err error) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("versioning: savepoint for parked event %s: %w", p.EventID, err)
	}
	herr := callApply(ctx, sp, p, apply)
	if herr == nil {
		if err := sp.Commit(ctx); err != nil {
			return false, fmt.Errorf("versioning: release savepoint of parked event %s: %w", p.EventID, err)
		}
		return true, nil
	}
	if err := sp.Rollback(ctx); err != nil {
		return false, fmt.Errorf("versioning: roll back parked event %s after its handler failed: %w", p.EventID, errors.Join(herr, err))
	}
	if _, err := tx.Exec(ctx, s.q.failParked, p.Group, p.AggregateType, p.AggregateID, p.Version, herr.Error()); err != nil {
		return false, fmt.Errorf("versioning: record failed release of parked event %s: %w", p.EventID, err)
	}
	failed := p
	failed.ReleaseAttempts++
	failed.LastError = herr.Error()
	res.Failed, res.FailErr = &failed, herr
	return false, nil
}

func callApply(ctx context.Context, tx pgx.Tx, p Parked, apply ApplyFunc) (err error) {
	if apply == nil {
		return fmt.Errorf("%w: %s (handler %q)", ErrNoHandler, p.EventID, p.Handler)
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic while applying parked event %s: %v\n%s", p.EventID, r, debug.Stack())
		}
	}()
	return apply(ctx, tx, p)
}

// removeParked deletes a parked row and records the event's final outcome.
func (s *Store) removeParked(ctx context.Context, tx pgx.Tx, p Parked, outcome dedup.Outcome) error {
	if _, err := tx.Exec(ctx, s.q.deleteParked, p.Group, p.AggregateType, p.AggregateID, p.Version); err != nil {
		return fmt.Errorf("versioning: remove parked event %s: %w", p.EventID, err)
	}
	return s.dedup.SetOutcome(ctx, tx, p.Group, p.EventID, outcome)
}
