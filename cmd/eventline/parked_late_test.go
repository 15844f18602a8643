package main

import (
	"context"
	"io"
	"log/slog"
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
// by `parked late`, applied by the running consumer's sweeper after
// `parked apply-late` with the handler told it is late, or dropped by
// `parked discard-late`.
func TestParkedLateApplyAndDiscard(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	el, err := middleware.New(middleware.Config{DB: env.Pool, Schema: env.Schema, Group: "billing", ParkTimeout: time.Nanosecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	var mu sync.Mutex
	lateCalls := map[string]bool{}
	h := el.Middleware(func(msg *message.Message) ([]*message.Message, error) {
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
	_, err = el.Sweep(ctx) // gives up on v2 of both
	require.NoError(t, err)
	lateA, lateB := deliver("a", 2), deliver("b", 2)

	out := ok(t, env.Schema, "parked", "late")
	require.Regexp(t, `GROUP\s+AGGREGATE\s+VERSION\s+EVENT ID\s+TYPE\s+KIND\s+HELD FOR\s+APPLY\s+ATTEMPTS\s+REASON`, out)
	require.Regexp(t, `billing\s+thing/a\s+2\s+`+lateA+`\s+thing.changed\s+arrived_late\s+\S+\s+-\s+0\s+park timeout`, out)
	type late struct {
		EventID        string `json:"event_id"`
		Kind           string `json:"kind"`
		Version        int64  `json:"version"`
		CurrentVersion int64  `json:"current_version_when_held"`
		Payload        map[string]any
	}
	list := okJSON[[]late](t, env.Schema, "parked", "late", "-aggregate", "thing/a", "-json")
	require.Len(t, list, 1)
	require.Equal(t, late{EventID: lateA, Kind: "arrived_late", Version: 2, CurrentVersion: 3, Payload: map[string]any{"id": "a", "v": 2.0}}, list[0])

	out = ok(t, env.Schema, "parked", "apply-late", "billing", lateA, "nope")
	require.Contains(t, out, "1 late event to apply: the sweeper of a running billing consumer applies them on its next pass")
	require.Contains(t, out, "1 of the 2 ids given are not late events of group billing")
	_, err = el.Sweep(ctx)
	require.NoError(t, err)
	mu.Lock()
	require.True(t, lateCalls[lateA], "applied, marked late")
	_, bCalled := lateCalls[lateB]
	mu.Unlock()
	require.False(t, bCalled, "only what the operator asked for")

	out = ok(t, env.Schema, "parked", "discard-late", "-aggregate", "thing/b", "billing")
	require.Contains(t, out, "discarded 1 late event of group billing")
	require.Contains(t, ok(t, env.Schema, "parked", "late"), "no late events")
	r := cli(t, append(dbArgs(env.Schema), "parked", "apply-late", "billing")...)
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "give the ids of the late events")
}
