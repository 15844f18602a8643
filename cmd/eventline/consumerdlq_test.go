package main

import (
	"bytes"
	"context"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
)

func TestConsumerDLQListReplayDiscard(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	st, err := store.New(env.Schema)
	require.NoError(t, err)
	add := func(group, agg string, v int64, kind string, payload []byte, md map[string]string) int64 {
		e := consumertest.Event(agg, v)
		id, err := st.AddDeadLetter(ctx, env.Pool, store.DeadLetter{Group: group, Topic: "orders", Handler: "h", FromKafka: true, Offset: v,
			MessageUUID: e.ID, Payload: payload, Metadata: md, EventID: e.ID, EventType: e.Type, AggregateType: e.AggregateType,
			AggregateID: e.AggregateID, AggregateVersion: v, Kind: kind, Reason: "the tax service said no"})
		require.NoError(t, err)
		return id
	}
	a2 := add("billing", "a", 2, dedup.KindRetriesExhausted, []byte(`{"n":2}`), map[string]string{"k": "v"})
	binary := []byte{0, 0xff, 1}
	b1 := add("billing", "b", 1, dedup.KindPermanent, binary, map[string]string{"x-bin": "\x00\xff", "ok": "text"})
	s1 := add("shipping", "a", 1, dedup.KindPermanent, []byte(`{}`), nil)

	out := ok(t, env.Schema, "consumer-dlq", "list")
	require.Regexp(t, `ID\s+GROUP\s+EVENT ID\s+TYPE\s+AGGREGATE\s+VERSION\s+KIND\s+STATUS`, out)
	require.Regexp(t, strconv.FormatInt(a2, 10)+`\s+billing\s+\S+\s+thing.changed\s+thing/a\s+2\s+retries_exhausted\s+dead`, out)
	require.Contains(t, out, "shipping")

	type item struct {
		ID             int64             `json:"id"`
		Group          string            `json:"group"`
		Status         string            `json:"status"`
		Kind           string            `json:"kind"`
		Offset         *int64            `json:"offset"`
		Metadata       map[string]string `json:"metadata"`
		BinaryMetadata []struct {
			Key   []byte `json:"key_base64"`
			Value []byte `json:"value_base64"`
		} `json:"binary_metadata"`
		Payload       map[string]any `json:"payload"`
		PayloadBase64 []byte         `json:"payload_base64"`
	}
	list := okJSON[[]item](t, env.Schema, "consumer-dlq", "list", "-group", "billing", "-json")
	require.Len(t, list, 2)
	require.Equal(t, a2, list[0].ID)
	require.EqualValues(t, 2, list[0].Payload["n"])
	require.EqualValues(t, 2, *list[0].Offset)
	require.Equal(t, map[string]string{"ok": "text"}, list[1].Metadata)
	require.Len(t, list[1].BinaryMetadata, 1)
	require.Equal(t, []byte("\x00\xff"), list[1].BinaryMetadata[0].Value, "binary headers are shown exactly")
	require.True(t, bytes.Equal(binary, list[1].PayloadBase64))

	// Replay the billing ones; the shipping one stays.
	out = ok(t, env.Schema, "consumer-dlq", "replay", "-group", "billing", "-all")
	require.Contains(t, out, "replay requested for 2 dead letters")
	list = okJSON[[]item](t, env.Schema, "consumer-dlq", "list", "-status", "replay_requested", "-json")
	require.Len(t, list, 2)
	r := cli(t, append(dbArgs(env.Schema), "consumer-dlq", "replay", strconv.FormatInt(a2, 10))...)
	require.Equal(t, exitFailure, r.code, "already requested")
	require.Contains(t, r.stderr, "no dead letter matched")

	// Discard needs a reason; then the dead letter is resolved.
	r = cli(t, append(dbArgs(env.Schema), "consumer-dlq", "discard", strconv.FormatInt(s1, 10))...)
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "-reason is required")
	out = ok(t, env.Schema, "consumer-dlq", "discard", "-reason", "refunded by hand", strconv.FormatInt(s1, 10), strconv.FormatInt(b1, 10))
	require.Contains(t, out, "discarded 2 dead letters")
	list = okJSON[[]item](t, env.Schema, "consumer-dlq", "list", "-status", "discarded", "-json")
	require.Len(t, list, 2)
	out = ok(t, env.Schema, "consumer-dlq", "list", "-group", "shipping")
	require.Contains(t, out, "no consumer dead letters (unresolved)")

	// Usage errors.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"consumer-dlq", "replay"}, "give the ids"},
		{[]string{"consumer-dlq", "replay", "-all"}, "-all needs -group or -aggregate"},
		{[]string{"consumer-dlq", "replay", "-all", "-group", "g", "3"}, "not both"},
		{[]string{"consumer-dlq", "replay", "x"}, `"x" is not a dead letter id`},
		{[]string{"consumer-dlq", "list", "-status", "sleepy"}, `-status "sleepy"`},
		{[]string{"consumer-dlq", "list", "-aggregate", "noslash"}, "want TYPE/ID"},
	} {
		r := cli(t, append(dbArgs(env.Schema), tc.args...)...)
		require.Equal(t, exitUsage, r.code, "%v", tc.args)
		require.Contains(t, r.stderr, tc.want)
	}
}
