package store

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// ErrNothingParked is returned by ReleaseGap when the aggregate has no
// parked events, so there is no gap to release.
var ErrNothingParked = errors.New("eventline: the aggregate has no parked events")

// Release reports what ReleaseGap did.
type Release struct {
	Key
	// From and To are the versions recorded as skipped; both are 0 when
	// the lowest parked event was already next in line.
	From, To int64
	// Ready is the number of parked events that are now next in line,
	// consecutively; a running consumer's sweeper applies them on its
	// next pass.
	Ready int
	// Late counts parked events held as late because the
	// aggregate had already passed their version.
	Late int
}

// ReleaseGap gives up on the missing versions in front of an aggregate's
// lowest parked event, for an operator who knows they will never arrive
// (`eventline parked release`). In one transaction holding the aggregate's
// lock it records the gap in skipped_versions with reason, and moves the
// aggregate's version to the lowest parked event's predecessor. It applies
// nothing: it runs no handler, so it needs only the database; a running
// consumer's sweeper applies the now-ready events on its next pass. Should
// a skipped version arrive later, it is late (see LatePolicy).
//
// It returns ErrNothingParked when the aggregate has no parked events.
// reason is required: it is the audit trail of why versions were skipped.
func (s *Store) ReleaseGap(ctx context.Context, db Beginner, group, aggregateType, aggregateID, reason string) (Release, error) {
	k := Key{Group: group, AggregateType: aggregateType, AggregateID: aggregateID}
	rel := Release{Key: k}
	switch {
	case group == "" || aggregateType == "" || aggregateID == "":
		return rel, errors.New("eventline: ReleaseGap: group, aggregate type and aggregate id are all required")
	case strings.TrimSpace(reason) == "":
		return rel, errors.New("eventline: ReleaseGap: reason is empty: say why the missing versions are given up, it is kept in skipped_versions")
	}
	nothing := false
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		rel = Release{Key: k}
		current, _, ok, err := s.lock(ctx, tx, k, false)
		if err != nil {
			return err
		}
		if !ok {
			nothing = true
			return nil
		}
		parked, err := s.parkedOf(ctx, tx, k, 0)
		if err != nil {
			return err
		}
		for len(parked) > 0 && parked[0].Version <= current {
			if err := s.passParked(ctx, tx, parked[0], current); err != nil {
				return err
			}
			rel.Late++
			parked = parked[1:]
		}
		if len(parked) == 0 {
			nothing = true
			if rel.Late > 0 {
				return s.setVersion(ctx, tx, k, current, -rel.Late)
			}
			return nil
		}
		to := current
		if prev := parked[0].PreviousVersion; prev > current {
			rel.From, rel.To = current+1, prev
			if err := s.RecordSkipped(ctx, tx, k, rel.From, rel.To, releaseMarker+reason); err != nil {
				return err
			}
			to = prev
		}
		if err := s.setVersion(ctx, tx, k, to, -rel.Late); err != nil {
			return err
		}
		for _, p := range parked {
			if p.PreviousVersion > to {
				break
			}
			rel.Ready++
			to = p.Version
		}
		return nil
	})
	if err != nil {
		return Release{Key: k}, fmt.Errorf("eventline: release gap of %s: %w", k, err)
	}
	if nothing {
		return rel, fmt.Errorf("%w: %s", ErrNothingParked, k)
	}
	return rel, nil
}
