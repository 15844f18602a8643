package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// GapOutcome says how a version gap in front of a parked event closed.
type GapOutcome string

// The outcomes of a closed gap.
const (
	// GapFilled: the missing version arrived and was applied.
	GapFilled GapOutcome = "filled"
	// GapSkipped: the sweeper gave up on the missing versions after the
	// park timeout.
	GapSkipped GapOutcome = "skipped"
	// GapReleased: an operator gave up on them (ReleaseGap, `eventline
	// parked release`); reported by the sweeper that then applies the
	// parked events.
	GapReleased GapOutcome = "released"
)

// ClosedGap is a gap in front of an aggregate's lowest parked event that
// closed: reported in DrainResult and SweepResult so the caller can
// observe how long gaps stay open (after its transaction committed).
type ClosedGap struct {
	Key
	Outcome GapOutcome
	// Open is how long the gap was open: from when the oldest of the
	// aggregate's parked events (from the one that waited on the gap on)
	// parked until the gap closed.
	Open time.Duration
}

// releaseMarker prefixes the reason of the skips ReleaseGap records.
const releaseMarker = "released by operator: "

// gapOpen is how long the gap in front of ps (the parked events from the
// one that waited on it on) was open at until: since the earliest of them
// parked, never negative (the parked_at times come from the database
// clock); 0 for none.
func gapOpen(ps []Parked, until time.Time) time.Duration {
	var since time.Time
	for _, p := range ps {
		if since.IsZero() || p.ParkedAt.Before(since) {
			since = p.ParkedAt
		}
	}
	if since.IsZero() {
		return 0
	}
	return max(until.Sub(since), 0)
}

var releasedAtSQL = statement(`SELECT skipped_at FROM {schema}.skipped_versions
	WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND to_version = $4 AND starts_with(reason, $5)
	ORDER BY id DESC LIMIT 1`)

// releasedAt returns when an operator's ReleaseGap moved the aggregate to
// version prev (recording the skip up to it), if one did: then the gap in
// front of the parked event that follows prev was released.
func (s *Store) releasedAt(ctx context.Context, tx pgx.Tx, k Key, prev int64) (time.Time, bool, error) {
	var at time.Time
	err := tx.QueryRow(ctx, s.q(releasedAtSQL), k.Group, k.AggregateType, k.AggregateID, prev, releaseMarker).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, false, fmt.Errorf("eventline: look for a released gap of %s: %w", k, err)
	}
	return at, true, nil
}
