package main

import (
	"bytes"
	"context"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
)

// Consumer dead letters through `held`: listed (binary payload and
// headers exactly), replayed per group (asked of the running consumer),
// discarded with a reason.
func TestHeldConsumerDeadLettersListReplayDiscard(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	store := held.New(env.Schema)
	add := func(group, agg string, v int64, kind string, payload []byte, md map[string]string) int64 {
		e := consumertest.Event(agg, v)
		id, err := store.AddDeadLetter(ctx, env.Pool, held.Event{Group: group, Topic: "orders", Handler: "h", FromKafka: true, Offset: v,
			MessageUUID: e.ID, Payload: payload, Metadata: md, EventID: e.ID, EventType: e.Type, AggregateType: e.AggregateType,
			AggregateID: e.AggregateID, AggregateVersion: v, Cause: kind, Reason: "the tax service said no"})
		require.NoError(t, err)
		return id
	}
	a2 := add("billing", "a", 2, dedup.KindRetriesExhausted, []byte(`{"n":2}`), map[string]string{"k": "v"})
	binary := []byte{0, 0xff, 1}
	b1 := add("billing", "b", 1, dedup.KindPermanent, binary, map[string]string{"x-bin": "\x00\xff", "ok": "text"})
	s1 := add("shipping", "a", 1, dedup.KindPermanent, []byte(`{}`), nil)

	out := ok(t, env.Schema, "held", "list", "-kind", "dead_letter")
	require.Regexp(t, `ID\s+KIND\s+GROUP\s+EVENT ID\s+TYPE\s+AGGREGATE\s+VERSION\s+CAUSE\s+STATUS`, out)
	require.Regexp(t, strconv.FormatInt(a2, 10)+`\s+dead_letter\s+billing\s+\S+\s+thing.changed\s+thing/a\s+2\s+retries_exhausted\s+held`, out)
	require.Contains(t, out, "shipping")

	type item struct {
		ID             int64             `json:"id"`
		Group          string            `json:"group"`
		Status         string            `json:"status"`
		Kind           string            `json:"kind"`
		Cause          string            `json:"cause"`
		Offset         *int64            `json:"offset"`
		Metadata       map[string]string `json:"metadata"`
		BinaryMetadata []struct {
			Key   []byte `json:"key_base64"`
			Value []byte `json:"value_base64"`
		} `json:"binary_metadata"`
		Payload       map[string]any `json:"payload"`
		PayloadBase64 []byte         `json:"payload_base64"`
	}
	list := okJSON[[]item](t, env.Schema, "held", "list", "-group", "billing", "-json")
	require.Len(t, list, 2)
	require.Equal(t, a2, list[0].ID)
	require.Equal(t, []string{"dead_letter", "retries_exhausted", "held"}, []string{list[0].Kind, list[0].Cause, list[0].Status})
	require.EqualValues(t, 2, list[0].Payload["n"])
	require.EqualValues(t, 2, *list[0].Offset)
	require.Equal(t, map[string]string{"ok": "text"}, list[1].Metadata)
	require.Len(t, list[1].BinaryMetadata, 1)
	require.Equal(t, []byte("\x00\xff"), list[1].BinaryMetadata[0].Value, "binary headers are shown exactly")
	require.True(t, bytes.Equal(binary, list[1].PayloadBase64))

	// Replay the billing ones; the shipping one stays.
	out = ok(t, env.Schema, "held", "replay", "-group", "billing", "-all")
	require.Contains(t, out, "replay requested for 2 held events")
	list = okJSON[[]item](t, env.Schema, "held", "list", "-status", "replay_requested", "-json")
	require.Len(t, list, 2)
	r := cli(t, append(dbArgs(env.Schema), "held", "replay", strconv.FormatInt(a2, 10))...)
	require.Equal(t, exitFailure, r.code, "already requested")
	require.Contains(t, r.stderr, "none of the ids given is a held event waiting for you")

	// Discard needs a reason; then the dead letter is resolved.
	r = cli(t, append(dbArgs(env.Schema), "held", "discard", strconv.FormatInt(s1, 10))...)
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "-reason is required")
	out = ok(t, env.Schema, "held", "discard", "-reason", "refunded by hand", strconv.FormatInt(s1, 10), strconv.FormatInt(b1, 10))
	require.Contains(t, out, "discarded 2 held events")
	list = okJSON[[]item](t, env.Schema, "held", "list", "-status", "discarded", "-json")
	require.Len(t, list, 2)
	out = ok(t, env.Schema, "held", "list", "-group", "shipping")
	require.Contains(t, out, "no held events (open)")

	// Usage errors.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"held", "replay"}, "give the ids"},
		{[]string{"held", "replay", "-all"}, "-all needs -kind, -group or -aggregate"},
		{[]string{"held", "replay", "-all", "-group", "g", "3"}, "not both"},
		{[]string{"held", "replay", "x"}, `"x" is not a held event id`},
		{[]string{"held", "list", "-status", "sleepy"}, `-status "sleepy"`},
		{[]string{"held", "list", "-aggregate", "noslash"}, "want TYPE/ID"},
	} {
		r := cli(t, append(dbArgs(env.Schema), tc.args...)...)
		require.Equal(t, exitUsage, r.code, "%v", tc.args)
		require.Contains(t, r.stderr, tc.want)
	}
}
