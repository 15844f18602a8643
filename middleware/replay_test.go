package middleware_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

func TestReplayStopsAnAggregateAtItsFirstFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	el, err := middleware.New(middleware.Config{DB: env.Pool, Schema: env.Schema, Group: group, Logger: quiet()})
	require.NoError(t, err)
	broken := true
	el.Register("billing", func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.TxFromContext(msg.Context())
		e, _ := middleware.EventFromContext(msg.Context())
		if broken && e.AggregateID == "x" {
			return nil, errors.New("still broken")
		}
		return nil, env.Apply(msg.Context(), tx, group, e)
	})
	store := el.DeadLetters().Store()
	add := func(e eventline.Event, offset int64) int64 {
		msg := consumertest.Message(t, e)
		id, err := store.Add(ctx, env.Pool, dedup.DeadLetter{Group: group, Topic: "orders", Handler: "billing", FromKafka: true, Offset: offset,
			MessageUUID: msg.UUID, Payload: msg.Payload, Metadata: msg.Metadata, EventID: e.ID, EventType: e.Type,
			AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion, Kind: dedup.KindRetriesExhausted, Reason: "r"})
		require.NoError(t, err)
		return id
	}
	x1, x2, y1 := consumertest.Event("x", 1), consumertest.Event("x", 2), consumertest.Event("y", 1)
	idX2, idX1, idY1 := add(x2, 5), add(x1, 3), add(y1, 4) // x2 died first: the replay still goes by version
	again, err := store.Add(ctx, env.Pool, dedup.DeadLetter{Group: group, Topic: "orders", Handler: "billing", FromKafka: true, Offset: 5,
		MessageUUID: x2.ID, Kind: dedup.KindPermanent, Reason: "died again"})
	require.NoError(t, err)
	require.Equal(t, idX2, again, "the same record dead-lettered again re-opens its row")

	ids, err := store.RequestReplay(ctx, env.Pool, dedup.DeadLetterFilter{Group: group})
	require.NoError(t, err)
	require.ElementsMatch(t, []int64{idX1, idX2, idY1}, ids)
	res, err := el.ReplayDeadLetters(ctx)
	require.NoError(t, err)
	require.Equal(t, middleware.ReplayResult{Replayed: 1, Failed: 2}, res)
	dead, err := store.List(ctx, env.Pool, dedup.DeadLetterFilter{Group: group, IDs: []int64{idX1, idX2}})
	require.NoError(t, err)
	require.Len(t, dead, 2)
	require.Equal(t, idX2, dead[0].ID)
	require.Contains(t, dead[0].LastReplayError, "not replayed: dead letter", "x2 is held back behind x1")
	require.Contains(t, dead[1].LastReplayError, "still broken")
	require.Equal(t, 1, dead[1].ReplayAttempts)
	require.Equal(t, 2, dead[0].Times)

	broken = false
	_, err = store.RequestReplay(ctx, env.Pool, dedup.DeadLetterFilter{AggregateType: "thing", AggregateID: "x"})
	require.NoError(t, err)
	res, err = el.ReplayDeadLetters(ctx)
	require.NoError(t, err)
	require.Equal(t, middleware.ReplayResult{Replayed: 2}, res)
	var order []int64
	for _, e := range env.Effects(t, group) {
		if e.AggregateID == "x" {
			order = append(order, e.Version)
		}
	}
	require.Equal(t, []int64{1, 2}, order)

	// Nothing left to replay; discarding needs a reason.
	_, err = store.RequestReplay(ctx, env.Pool, dedup.DeadLetterFilter{Group: group})
	require.ErrorIs(t, err, dedup.ErrNoDeadLetters)
	_, err = store.Discard(ctx, env.Pool, dedup.DeadLetterFilter{IDs: []int64{idY1}}, " ")
	require.Error(t, err)
}
