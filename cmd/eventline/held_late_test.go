package main

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

// A late event (its version was skipped after the park timeout) is listed
// by `held list`, applied by the running consumer's sweeper after `held
// replay` with the handler told it is late, or dropped by `held discard`.
func TestHeldLateEventsReplayAndDiscard(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	el, err := middleware.New(env.Pool, middleware.Config{Schema: env.Schema, Group: "billing", ParkTimeout: time.Nanosecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	var mu sync.Mutex
	lateCalls := map[string]bool{}
	h := el.MiddlewareFor("billing")(func(msg *message.Message) ([]*message.Message, error) {
		e, _ := middleware.EventFromContext(msg.Context())
		mu.Lock()
		lateCalls[e.ID] = middleware.IsLate(msg.Context())
		mu.Unlock()
		return nil, nil
	})
	deliver := func(id string, v int64) string {
		m := consumertest.Message(t, consumertest.Event(id, v))
		_, err := h(m)
		require.NoError(t, err)
		return m.UUID
	}
	for _, id := range []string{"a", "b"} {
		deliver(id, 1)
		deliver(id, 3)
	}
	err = el.Sweep(ctx) // gives up on v2 of both
	require.NoError(t, err)
	lateA, lateB := deliver("a", 2), deliver("b", 2)

	out := ok(t, env.Schema, "held", "list", "-kind", "late")
	require.Regexp(t, `ID\s+KIND\s+GROUP\s+EVENT ID\s+TYPE\s+AGGREGATE\s+VERSION\s+CAUSE\s+STATUS\s+HELD AT\s+ATTEMPTS\s+REASON`, out)
	require.Regexp(t, `late\s+billing\s+`+lateA+`\s+thing.changed\s+thing/a\s+2\s+arrived_late\s+held\s+\S+ \S+\s+0\s+park timeout`, out)
	type late struct {
		ID             int64  `json:"id"`
		EventID        string `json:"event_id"`
		Kind           string `json:"kind"`
		Cause          string `json:"cause"`
		Version        int64  `json:"aggregate_version"`
		CurrentVersion int64  `json:"current_version_when_held"`
		Payload        map[string]any
	}
	list := okJSON[[]late](t, env.Schema, "held", "list", "-aggregate", "thing/a", "-json")
	require.Len(t, list, 1)
	idA := list[0].ID
	require.Equal(t, late{ID: idA, EventID: lateA, Kind: "late", Cause: "arrived_late", Version: 2, CurrentVersion: 3, Payload: map[string]any{"id": "a", "v": 2.0}}, list[0])

	out = ok(t, env.Schema, "held", "replay", strconv.FormatInt(idA, 10), strconv.FormatInt(idA+1000, 10))
	require.Contains(t, out, "replay requested for 1 held event: "+strconv.FormatInt(idA, 10)+"; a running consumer of each group replays them on its next sweep")
	require.Contains(t, out, "1 of the 2 ids given were not waiting")
	err = el.Sweep(ctx)
	require.NoError(t, err)
	mu.Lock()
	require.True(t, lateCalls[lateA], "applied, marked late")
	_, bCalled := lateCalls[lateB]
	mu.Unlock()
	require.False(t, bCalled, "only what the operator asked for")
	replayed := okJSON[[]late](t, env.Schema, "held", "list", "-status", "replayed", "-json")
	require.Len(t, replayed, 1)
	require.Equal(t, lateA, replayed[0].EventID)

	out = ok(t, env.Schema, "held", "discard", "-reason", "superseded", "-group", "billing", "-aggregate", "thing/b", "-all")
	require.Contains(t, out, "discarded 1 held event")
	require.Contains(t, ok(t, env.Schema, "held", "list"), "no held events (open)")
	r := cli(t, append(dbArgs(env.Schema), "held", "replay", "-group", "billing")...)
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "give the ids of the held events")
}
