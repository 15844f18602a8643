package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
)

// statusGapsJSON is the gap part of `eventline status -json`.
type statusGapsJSON struct {
	Groups []struct {
		Group                string  `json:"group"`
		OpenGaps             int64   `json:"open_gaps"`
		OldestOpenGapSeconds float64 `json:"oldest_open_gap_seconds"`
		OpenGapList          []struct {
			AggregateType string `json:"aggregate_type"`
			AggregateID   string `json:"aggregate_id"`
			Current       int64  `json:"current_version"`
			MissingFrom   int64  `json:"missing_from"`
			MissingTo     int64  `json:"missing_to"`
			Parked        int64  `json:"parked"`
		} `json:"open_gap_list"`
		SkippedGaps24h int64 `json:"skipped_gaps_24h"`
		LateEvents     int64 `json:"late_events"`
		DeadLetters    int64 `json:"dead_letters"`
	} `json:"consumer_groups"`
}

// TestStatusShowsGapsAndStalls: per group, status lists the open gaps
// (aggregate, missing versions, age), the gaps skipped in the last day,
// late events and unresolved dead letters, in text and JSON. Before: no
// "Gaps and stalls" section and no such fields.
func TestStatusShowsGapsAndStalls(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	parkGap(t, env, "billing", "a1", 1, 4, 5) // waits for v2..v3
	parkGap(t, env, "shipping", "b", 0, 2)    // waits for v1
	ok(t, env.Schema, "parked", "release", "-reason", "lost", "shipping", "thing/b")
	_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+
		` (kind, consumer_group, message_uuid, payload, header_keys, header_values, cause, reason)
		VALUES ('dead_letter', 'billing', '\x01', '\x00', '{}', '{}', 'permanent', 'r')`)
	require.NoError(t, err)

	st := okJSON[statusGapsJSON](t, env.Schema, "status", "-json")
	require.Len(t, st.Groups, 2)
	b, s := st.Groups[0], st.Groups[1]
	require.Equal(t, "billing", b.Group)
	require.EqualValues(t, 1, b.OpenGaps)
	require.Positive(t, b.OldestOpenGapSeconds)
	require.Len(t, b.OpenGapList, 1)
	g := b.OpenGapList[0]
	require.Equal(t, []any{"thing", "a1", int64(1), int64(2), int64(3), int64(2)}, []any{g.AggregateType, g.AggregateID, g.Current, g.MissingFrom, g.MissingTo, g.Parked})
	require.EqualValues(t, 1, b.DeadLetters)
	require.Equal(t, "shipping", s.Group)
	require.Zero(t, s.OpenGaps, "released: the parked event is ready, no gap")
	require.EqualValues(t, 1, s.SkippedGaps24h)

	out := ok(t, env.Schema, "status")
	require.Contains(t, out, "Gaps and stalls:")
	require.Regexp(t, `billing: 1 open gap \(oldest \S+\), 0 gaps skipped in the last 24h, 0 late events held, 1 dead letter not resolved`, out)
	require.Regexp(t, `thing/a1 at version 1, waiting for versions 2\.\.3 for \S+ \(2 parked events\)`, out)
	require.Regexp(t, `shipping: 0 open gaps, 1 gap skipped in the last 24h`, out)
	require.Contains(t, out, "eventline parked list")
}
