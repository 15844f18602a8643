package versioning_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/versioning"
)

// outcomes lists the outcomes of closed gaps.
func outcomes(gaps []versioning.ClosedGap) []versioning.GapOutcome {
	var out []versioning.GapOutcome
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
	a := &applied{fail: func(versioning.Parked) error {
		if fail {
			return errors.New("not yet")
		}
		return nil
	}}
	opts := versioning.ReleaseOptions{Apply: a.apply, Backoff: eventline.Backoff{Initial: time.Nanosecond}}
	k := versioning.Key{Group: "g", AggregateType: "acct", AggregateID: "f"}

	// Filled: f v1, v3 parked, then v2 arrives and drains; v3 fails.
	require.Equal(t, versioning.Next, deliver(t, s, env, "f", 1))
	require.Equal(t, versioning.Gap, deliver(t, s, env, "f", 3))
	var d versioning.DrainResult
	require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		ad := admit(t, s, tx, ev("f", 2), false, true)
		require.Equal(t, versioning.Next, ad.Verdict)
		var err error
		d, err = s.Drain(ctx, tx, k, ad.Current, opts)
		return err
	}))
	require.Equal(t, []versioning.GapOutcome{versioning.GapFilled}, outcomes(d.GapsClosed))
	require.Equal(t, k, d.GapsClosed[0].Key)
	require.NotNil(t, d.Failed)

	// Released: r v1, v3 parked, released by an operator.
	require.Equal(t, versioning.Next, deliver(t, s, env, "r", 1))
	require.Equal(t, versioning.Gap, deliver(t, s, env, "r", 3))
	_, err := s.ReleaseGap(ctx, env.Pool, "g", "acct", "r", "v2 lost")
	require.NoError(t, err)
	w, err := s.NewSweeper(env.Pool, versioning.SweeperConfig{Group: "g", ParkTimeout: time.Hour, Apply: a.apply, ReleaseBackoff: eventline.Backoff{Initial: time.Nanosecond}})
	require.NoError(t, err)
	res, err := w.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, res.Failed)
	require.Empty(t, res.GapsClosed, "nothing applied yet")

	fail = false
	res, err = w.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, res.Released)
	require.Equal(t, []versioning.GapOutcome{versioning.GapReleased}, outcomes(res.GapsClosed), "f's gap was reported when it was filled")
	require.Equal(t, "r", res.GapsClosed[0].AggregateID)
	res, err = w.Sweep(ctx)
	require.NoError(t, err)
	require.Empty(t, res.GapsClosed)

	// Skipped: the park timeout expires.
	require.Equal(t, versioning.Gap, deliver(t, s, env, "x", 2))
	w, err = s.NewSweeper(env.Pool, versioning.SweeperConfig{Group: "g", ParkTimeout: time.Nanosecond, Apply: a.apply})
	require.NoError(t, err)
	res, err = w.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, []versioning.GapOutcome{versioning.GapSkipped}, outcomes(res.GapsClosed))
	require.Positive(t, res.GapsClosed[0].Open)
}
