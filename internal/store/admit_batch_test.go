package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/store"
)

// queueBatch admits events in one statement on tx; nil when the batch
// does not have the shape for it.
func queueBatch(ctx context.Context, s *store.Store, tx pgx.Tx, events []eventline.Event, jumps []bool) ([]store.Admission, bool, error) {
	b := &pgx.Batch{}
	p := s.QueueAdmitBatch(b, "g", events, jumps, store.AdmissionOrder(events))
	if p == nil {
		return nil, false, nil
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, true, err
	}
	a, err := p.Result()
	return a, true, err
}

// TestAdmitBatchIsAdmittingOneByOne: a batch admitted in one statement
// reads, member by member, what admitting its members one after the other
// (in lock order: by aggregate, arrival order within one) reads, and leaves
// the same versions; when a member was recorded before, it says so (and the
// caller admits them one by one).
func TestAdmitBatchIsAdmittingOneByOne(t *testing.T) {
	t.Parallel()
	s, env := newStore(t)
	ctx := context.Background()
	n, compared, refused := 0, 0, 0
	rapid.Check(t, func(rt *rapid.T) {
		n++
		aggs := []string{fmt.Sprintf("a%d", n), fmt.Sprintf("b%d", n), fmt.Sprintf("c%d", n)}
		tx, err := env.Pool.Begin(ctx)
		require.NoError(rt, err)
		defer tx.Rollback(ctx)

		// The aggregates' state before the batch: some events admitted.
		var before []eventline.Event
		for range rapid.IntRange(0, 6).Draw(rt, "before") {
			e := ev(rapid.SampledFrom(aggs).Draw(rt, "agg"), rapid.Int64Range(1, 8).Draw(rt, "v"))
			_, err := s.Admit(ctx, tx, "g", e, rapid.Bool().Draw(rt, "jump"))
			require.NoError(rt, err)
			before = append(before, e)
		}
		// The batch: per aggregate mostly a chain of consecutive versions
		// from a random start, sometimes with a declared predecessor, a
		// redelivery of an event admitted before, or a broken chain.
		jump := map[string]bool{}
		for _, a := range aggs {
			jump[a] = rapid.Bool().Draw(rt, "jump")
		}
		var events []eventline.Event
		next := map[string]int64{}
		for range rapid.IntRange(1, 10).Draw(rt, "members") {
			a := rapid.SampledFrom(aggs).Draw(rt, "agg")
			switch k := rapid.IntRange(0, 19).Draw(rt, "kind"); {
			case k == 0 && len(before) > 0:
				events = append(events, rapid.SampledFrom(before).Draw(rt, "redelivered"))
				continue
			case k == 1:
				next[a] += rapid.Int64Range(-1, 2).Draw(rt, "break")
			case next[a] == 0:
				next[a] = rapid.Int64Range(1, 10).Draw(rt, "start")
			}
			if next[a] < 1 {
				next[a] = 1
			}
			e := ev(a, next[a])
			if rapid.IntRange(0, 4).Draw(rt, "declared") == 0 {
				gap := rapid.Int64Range(1, 3).Draw(rt, "gap")
				e.AggregateVersion = next[a] + gap
				e.PreviousVersion = next[a] // declared: follows next[a]
				if next[a] == 0 {
					e.PreviousVersion = eventline.NoPreviousVersion
				}
			}
			next[a] = e.AggregateVersion + 1
			events = append(events, e)
		}
		jumps := make([]bool, len(events))
		for i, e := range events {
			jumps[i] = jump[e.AggregateID]
		}

		// One by one, in lock order.
		_, err = tx.Exec(ctx, "SAVEPOINT one_by_one")
		require.NoError(rt, err)
		order := make([]int, len(events))
		for i := range order {
			order[i] = i
		}
		slices.SortStableFunc(order, func(x, y int) int { return strings.Compare(events[x].AggregateID, events[y].AggregateID) })
		want := make([]store.Admission, len(events))
		recorded := false
		for _, i := range order {
			a, err := s.Admit(ctx, tx, "g", events[i], jumps[i])
			if errors.Is(err, dedup.ErrIDConflict) {
				recorded = true
				break
			}
			require.NoError(rt, err)
			want[i] = a
			recorded = recorded || a.Verdict == store.Duplicate
		}
		versions := func() map[string]int64 {
			m := map[string]int64{}
			for _, a := range aggs {
				v, err := s.Current(ctx, tx, store.Key{Group: "g", AggregateType: "acct", AggregateID: a})
				require.NoError(rt, err)
				m[a] = v
			}
			return m
		}
		wantVersions := versions()
		_, err = tx.Exec(ctx, "ROLLBACK TO SAVEPOINT one_by_one")
		require.NoError(rt, err)

		got, queued, err := queueBatch(ctx, s, tx, events, jumps)
		if !queued {
			return // not a chain per aggregate: admitted one by one
		}
		if recorded {
			require.ErrorIs(rt, err, store.ErrBatchRecorded)
			refused++
			return
		}
		require.NoError(rt, err)
		require.Equal(rt, want, got)
		require.Equal(rt, wantVersions, versions())
		compared++
	})
	t.Logf("%d batches admitted in one statement, %d refused as recorded before", compared, refused)
	require.Positive(t, compared)
}

// TestAdmitBatchShape: one statement admits a batch whose events of each
// aggregate follow one another under one policy; anything else is left
// to the member-by-member admission.
func TestAdmitBatchShape(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t)
	queued := func(events []eventline.Event, jumps []bool) bool {
		return s.QueueAdmitBatch(&pgx.Batch{}, "g", events, jumps, store.AdmissionOrder(events)) != nil
	}
	a1, b1, a2, a3 := ev("a", 1), ev("b", 1), ev("a", 2), ev("a", 3)
	require.True(t, queued([]eventline.Event{a1, b1, a2, a3}, []bool{false, true, false, false}))
	require.False(t, queued([]eventline.Event{a1, a3}, []bool{false, false}), "a gap inside the batch")
	require.False(t, queued([]eventline.Event{a2, a1}, []bool{false, false}), "out of order")
	require.False(t, queued([]eventline.Event{a1, a2}, []bool{false, true}), "two policies")
	require.False(t, queued([]eventline.Event{a1, ev("a", 0)}, []bool{false, false}), "unversioned")
	sparse := ev("a", 7)
	sparse.PreviousVersion = 3
	require.True(t, queued([]eventline.Event{a1, a2, a3, sparse}, []bool{false, false, false, false}), "a declared predecessor")
}
