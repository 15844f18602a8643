package store_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
)

// A dead letter whose aggregate holds a NUL byte or invalid UTF-8 (a
// hostile record) is stored with those bytes cleaned in its text columns;
// an operator selecting it by the aggregate it claimed finds it, and can
// discard it, instead of getting SQLSTATE 22021. Before: List, Discard
// and RequestReplay sent the raw filter and failed.
func TestDeadLettersOfHostileAggregatesCanBeSelected(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{MaxConns: 2})
	st, err := store.New(env.Schema)
	require.NoError(t, err)
	ctx := context.Background()
	for _, agg := range []string{"a\x00b", "caf\xc3", "plain"} {
		_, err := st.AddDeadLetter(ctx, env.Pool, store.DeadLetter{Group: "g\x00", AggregateType: "t\xff", AggregateID: agg, MessageUUID: agg,
			Metadata: map[string]string{"aggregate_id": agg}, Kind: dedup.KindPermanent, Reason: "bad"})
		require.NoError(t, err)
	}
	for _, agg := range []string{"a\x00b", "caf\xc3", "plain"} {
		f := store.DeadLetterFilter{Group: "g\x00", AggregateType: "t\xff", AggregateID: agg}
		dead, err := st.ListDeadLetters(ctx, env.Pool, f)
		require.NoError(t, err, "%q", agg)
		require.Len(t, dead, 1, "%q", agg)
		require.Equal(t, agg, dead[0].MessageUUID, "the bytes are kept")
		require.Equal(t, agg, dead[0].Metadata["aggregate_id"])
		ids, err := st.RequestReplay(ctx, env.Pool, f)
		require.NoError(t, err, "%q", agg)
		require.Equal(t, []int64{dead[0].ID}, ids)
		ids, err = st.DiscardDeadLetters(ctx, env.Pool, f, "hostile record")
		require.NoError(t, err, "%q", agg)
		require.Equal(t, []int64{dead[0].ID}, ids)
	}
}
