package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/store"
)

// outcomes lists the outcomes of closed gaps.
func outcomes(gaps []store.ClosedGap) []store.GapOutcome {
	var out []store.GapOutcome
	for _, g := range gaps {
		out = append(out, g.Outcome)
	}
	return out
}

// TestClosedGapsAreReportedOnce: a drain after the missing version arrived
// reports the gap filled (even when the parked event then fails to apply,
// and the sweeper that applies it later reports nothing more); an
// operator's release is reported by the sweeper once, on the pass that
// applies the event, not on passes where it fails; a park timeout skip is
// reported as skipped. Before: DrainResult and SweepResult had no closed
// gaps.
func TestClosedGapsAreReportedOnce(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	fail := true
	a := &applied{fail: func(store.Parked) error {
		if fail {
			return errors.New("not yet")
		}
		return nil
	}}
	opts := release(a.apply, time.Nanosecond)
	k := store.Key{Group: "g", AggregateType: "acct", AggregateID: "f"}

	// Filled: f v1, v3 parked, then v2 arrives and drains; v3 fails.
	require.Equal(t, store.Next, deliver(t, s, env, "f", 1))
	require.Equal(t, store.Gap, deliver(t, s, env, "f", 3))
	var d store.DrainResult
	require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		ad := admit(t, s, tx, ev("f", 2), false)
		require.Equal(t, store.Next, ad.Verdict)
		var err error
		d, err = s.Drain(ctx, tx, k, ad.Current, opts)
		return err
	}))
	require.Equal(t, []store.GapOutcome{store.GapFilled}, outcomes(d.GapsClosed))
	require.Equal(t, k, d.GapsClosed[0].Key)
	require.NotNil(t, d.Failed)

	// Released: r v1, v3 parked, released by an operator.
	require.Equal(t, store.Next, deliver(t, s, env, "r", 1))
	require.Equal(t, store.Gap, deliver(t, s, env, "r", 3))
	_, err := s.ReleaseGap(ctx, env.Pool, "g", "acct", "r", "v2 lost")
	require.NoError(t, err)
	w := s.NewSweeper(env.Pool, sweeper("g", time.Hour, opts))
	res, err := w.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, res.Failed)
	require.Empty(t, res.GapsClosed, "nothing applied yet")

	fail = false
	res, err = w.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, res.Released)
	require.Equal(t, []store.GapOutcome{store.GapReleased}, outcomes(res.GapsClosed), "f's gap was reported when it was filled")
	require.Equal(t, "r", res.GapsClosed[0].AggregateID)
	res, err = w.Sweep(ctx)
	require.NoError(t, err)
	require.Empty(t, res.GapsClosed)

	// Skipped: the park timeout expires.
	require.Equal(t, store.Gap, deliver(t, s, env, "x", 2))
	w = s.NewSweeper(env.Pool, sweeper("g", time.Nanosecond, release(a.apply, 0)))
	res, err = w.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, []store.GapOutcome{store.GapSkipped}, outcomes(res.GapsClosed))
	require.Positive(t, res.GapsClosed[0].Open)
}
