package main

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/versioning"
)

// parkGap runs aggregate "thing"/aggID through the version gate as a
// consumer of group would: versions 1..applied are applied, and each of
// park (all above applied+1) arrives early and is parked.
func parkGap(t testing.TB, env pgtest.Env, group, aggID string, applied int64, park ...int64) []eventline.Event {
	t.Helper()
	ctx := context.Background()
	st, err := store.New(env.Schema)
	require.NoError(t, err)
	for v := int64(1); v <= applied; v++ {
		require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
			a, err := st.Admit(ctx, tx, group, consumertest.Event(aggID, v), false)
			require.Equal(t, store.Next, a.Verdict)
			return err
		}))
	}
	var parked []eventline.Event
	for _, v := range park {
		e := consumertest.Event(aggID, v)
		require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
			a, err := st.Admit(ctx, tx, group, e, false)
			if err != nil {
				return err
			}
			require.Equal(t, store.Gap, a.Verdict)
			_, err = st.Park(ctx, tx, store.ParkRequest{Group: group, Event: e, Handler: "things", Topic: "things", MaxGap: versioning.DefaultMaxGap})
			return err
		}))
		parked = append(parked, e)
	}
	return parked
}

func TestParkedListReleaseSkipped(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	// billing applied a1 v1 and parked v3, v4 (v2 is missing); shipping
	// parked b v2 (v1 is missing).
	early := parkGap(t, env, "billing", "a1", 1, 3, 4)
	parkGap(t, env, "shipping", "b", 0, 2)

	out := ok(t, env.Schema, "parked", "list")
	require.Regexp(t, `GROUP\s+AGGREGATE\s+VERSION\s+CURRENT`, out)
	require.Regexp(t, `billing\s+thing/a1\s+3\s+1\s+`+early[0].ID, out)
	require.Regexp(t, `billing\s+thing/a1\s+4\s+1\s+`+early[1].ID, out)
	require.Regexp(t, `shipping\s+thing/b\s+2\s+0\s+`, out)
	require.Contains(t, out, "billing thing/a1: at version 1, waiting for version 2; to give up on them: eventline parked release -reason '...' billing thing/a1")
	require.Contains(t, out, "shipping thing/b: at version 0, waiting for version 1")

	type parked struct {
		Group          string            `json:"group"`
		AggregateID    string            `json:"aggregate_id"`
		Version        int64             `json:"version"`
		CurrentVersion int64             `json:"current_version"`
		EventID        string            `json:"event_id"`
		Handler        string            `json:"handler"`
		Metadata       map[string]string `json:"metadata"`
		Payload        map[string]any    `json:"payload"`
	}
	list := okJSON[[]parked](t, env.Schema, "parked", "list", "-group", "billing", "-json")
	require.Len(t, list, 2)
	require.Equal(t, early[0].ID, list[0].EventID)
	require.EqualValues(t, 3, list[0].Version)
	require.EqualValues(t, 1, list[0].CurrentVersion)
	require.Equal(t, "things", list[0].Handler)
	require.Equal(t, "a1", list[0].Metadata[eventline.MetaAggregateID])
	require.EqualValues(t, 3, list[0].Payload["v"])
	list = okJSON[[]parked](t, env.Schema, "parked", "list", "-aggregate", "thing/b", "-json")
	require.Len(t, list, 1)
	require.Equal(t, "shipping", list[0].Group)
	list = okJSON[[]parked](t, env.Schema, "parked", "list", "-limit", "1", "-json")
	require.Len(t, list, 1)

	// Releasing an aggregate without parked events changes nothing.
	r := cli(t, append(dbArgs(env.Schema), "parked", "release", "-reason", "lost", "billing", "thing/zzz")...)
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "no parked events for thing/zzz")

	// Flags may follow the arguments.
	out = ok(t, env.Schema, "parked", "release", "billing", "thing/a1", "-reason", "v2 was dropped from the DLQ")
	require.Contains(t, out, "billing thing/a1: gave up on version 2 (recorded in skipped_versions)")
	require.Contains(t, out, "2 parked events now ready")

	st, err := store.New(env.Schema)
	require.NoError(t, err)
	cur, err := st.Current(context.Background(), env.Pool, store.Key{Group: "billing", AggregateType: "thing", AggregateID: "a1"})
	require.NoError(t, err)
	require.EqualValues(t, 2, cur, "the version moved to just below the lowest parked event")
	list = okJSON[[]parked](t, env.Schema, "parked", "list", "-group", "billing", "-json")
	require.Len(t, list, 2, "release applies nothing; the consumer's sweeper does")
	out = ok(t, env.Schema, "parked", "list", "-group", "billing")
	require.Contains(t, out, "billing thing/a1: at version 2, nothing missing")

	type rel struct {
		SkippedFrom int64 `json:"skipped_from"`
		SkippedTo   int64 `json:"skipped_to"`
		Ready       int   `json:"ready"`
	}
	got := okJSON[rel](t, env.Schema, "parked", "release", "-json", "-reason", "never published", "shipping", "thing/b")
	require.Equal(t, rel{SkippedFrom: 1, SkippedTo: 1, Ready: 1}, got)

	type skipped struct {
		Group       string `json:"group"`
		AggregateID string `json:"aggregate_id"`
		From        int64  `json:"from_version"`
		To          int64  `json:"to_version"`
		Reason      string `json:"reason"`
	}
	sk := okJSON[[]skipped](t, env.Schema, "parked", "skipped", "-json")
	require.Len(t, sk, 2)
	require.Equal(t, "billing", sk[0].Group)
	require.EqualValues(t, 2, sk[0].From)
	require.EqualValues(t, 2, sk[0].To)
	require.Contains(t, sk[0].Reason, "v2 was dropped from the DLQ")
	sk = okJSON[[]skipped](t, env.Schema, "parked", "skipped", "-group", "shipping", "-json")
	require.Len(t, sk, 1)
	require.Equal(t, "b", sk[0].AggregateID)
	out = ok(t, env.Schema, "parked", "skipped", "-aggregate", "thing/a1")
	require.Regexp(t, `billing\s+thing/a1\s+version 2\s+`, out)
	require.NotContains(t, out, "thing/b")
}
