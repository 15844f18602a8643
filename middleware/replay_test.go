package middleware_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

func TestReplayStopsAnAggregateAtItsFirstFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	el, err := middleware.New(env.Pool, middleware.Config{Schema: env.Schema, Group: group, Logger: quiet()})
	require.NoError(t, err)
	broken := true
	_ = el.MiddlewareFor("billing")(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.TxFromContext(msg.Context())
		e, _ := middleware.EventFromContext(msg.Context())
		if broken && e.AggregateID == "x" {
			return nil, errors.New("still broken")
		}
		return nil, env.Apply(msg.Context(), tx, group, e)
	})
	hs := held.New(env.Schema)
	add := func(e eventline.Event, offset int64) int64 {
		msg := consumertest.Message(t, e)
		id, err := hs.AddDeadLetter(ctx, env.Pool, held.Event{Group: group, Topic: "orders", Handler: "billing", FromKafka: true, Offset: offset,
			MessageUUID: msg.UUID, Payload: msg.Payload, Metadata: msg.Metadata, EventID: e.ID, EventType: e.Type,
			AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion, Cause: dedup.KindRetriesExhausted, Reason: "r"})
		require.NoError(t, err)
		return id
	}
	x1, x2, y1 := consumertest.Event("x", 1), consumertest.Event("x", 2), consumertest.Event("y", 1)
	idX2, idX1, idY1 := add(x2, 5), add(x1, 3), add(y1, 4) // x2 died first: the replay still goes by version
	again, err := hs.AddDeadLetter(ctx, env.Pool, held.Event{Group: group, Topic: "orders", Handler: "billing", FromKafka: true, Offset: 5,
		MessageUUID: x2.ID, Cause: dedup.KindPermanent, Reason: "died again"})
	require.NoError(t, err)
	require.Equal(t, idX2, again, "the same record dead-lettered again re-opens its row")

	rr, err := admin.ReplayHeld(ctx, env.Pool, env.Schema, admin.HeldFilter{Group: group})
	require.NoError(t, err)
	require.Equal(t, []int64{idX1, idX2, idY1}, rr.Requested, "per aggregate in version order")
	res, err := el.ReplayDeadLetters(ctx)
	require.NoError(t, err)
	require.Equal(t, middleware.ReplayResult{Replayed: 1, Failed: 2}, res)
	dead, err := hs.List(ctx, env.Pool, held.Filter{Group: group, IDs: []int64{idX1, idX2}})
	require.NoError(t, err)
	require.Len(t, dead, 2)
	require.Equal(t, idX2, dead[0].ID)
	require.Contains(t, dead[0].LastError, "not replayed: dead letter", "x2 is held back behind x1")
	require.Contains(t, dead[1].LastError, "still broken")
	require.Equal(t, 1, dead[1].Attempts)
	require.Equal(t, held.StatusHeld, dead[1].Status, "a failed replay is held again")
	require.Equal(t, 2, dead[0].Times)

	broken = false
	_, err = admin.ReplayHeld(ctx, env.Pool, env.Schema, admin.HeldFilter{AggregateType: "thing", AggregateID: "x"})
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
	_, err = admin.ReplayHeld(ctx, env.Pool, env.Schema, admin.HeldFilter{Group: group})
	require.ErrorIs(t, err, admin.ErrNoHeld)
	_, err = admin.DiscardHeld(ctx, env.Pool, env.Schema, admin.HeldFilter{IDs: []int64{idY1}}, " ")
	require.Error(t, err)
}

// A replayed dead letter whose version the aggregate has since passed
// is held for the operator as a version conflict, never discarded as
// stale: as late (cause version_conflict), its reason naming the event that
// applied the version when that event is still recorded, its dedup
// outcome late, so the operator applies it (marked late) or discards it.
// A dead letter of an event applied since is a duplicate, as before.
// Before: both conflicts were discarded as stale and their dead letters
// marked replayed, silently.
func TestReplayedDeadLetterWhoseVersionWasTakenIsHeldAsAConflict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, middleware.Config{})
	log := &lateLog{calls: map[string][]bool{}}
	f.observe = log.observe
	hs := held.New(f.env.Schema)
	offset := int64(0)
	dead := func(e eventline.Event) int64 {
		msg := consumertest.Message(t, e)
		offset++
		id, err := hs.AddDeadLetter(ctx, f.env.Pool, held.Event{Group: group, Topic: "orders", Handler: "billing", FromKafka: true, Offset: offset,
			MessageUUID: msg.UUID, Payload: msg.Payload, Metadata: msg.Metadata, EventID: e.ID, EventType: e.Type,
			AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion, Cause: dedup.KindRetriesExhausted, Reason: "r"})
		require.NoError(t, err)
		return id
	}
	sparse := func(id string, v, prev int64) eventline.Event {
		e := consumertest.Event(id, v)
		e.PreviousVersion = prev
		return e
	}

	// a: v2 died; another event with version 2 was applied since.
	taker := consumertest.Event("a", 2)
	a2 := consumertest.Event("a", 2)
	// b: v5 died; v10 said it follows v1, so nothing ever applied v5.
	b5 := sparse("b", 5, 4)
	// c: v2 died and was applied since (a redelivery): a duplicate.
	c2 := consumertest.Event("c", 2)
	for _, e := range []eventline.Event{consumertest.Event("a", 1), taker, consumertest.Event("b", 1), sparse("b", 10, 1), consumertest.Event("c", 1), c2} {
		require.NoError(t, f.deliver(t, consumertest.Message(t, e)))
	}
	dead(a2)
	dead(b5)
	dead(c2)
	_, err := admin.ReplayHeld(ctx, f.env.Pool, f.env.Schema, admin.HeldFilter{Kind: admin.HeldDeadLetter, Group: group})
	require.NoError(t, err)
	res, err := f.el.ReplayDeadLetters(ctx)
	require.NoError(t, err)
	require.Equal(t, middleware.ReplayResult{Replayed: 3}, res)

	held, err := admin.ListHeld(ctx, f.env.Pool, f.env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: group})
	require.NoError(t, err)
	require.Len(t, held, 2, "both conflicts are held, the duplicate is not")
	require.Equal(t, a2.ID, held[0].EventID)
	require.Equal(t, "version_conflict", held[0].Cause)
	require.Equal(t, "version 2 was applied by event "+taker.ID, held[0].Reason)
	require.EqualValues(t, 2, held[0].CurrentVersion)
	require.Equal(t, b5.ID, held[1].EventID)
	require.Equal(t, "version_conflict", held[1].Cause)
	require.Contains(t, held[1].Reason, "the aggregate passed version 5 without this event")
	require.Equal(t, dedup.OutcomeLate, f.outcome(t, a2.ID))
	require.Equal(t, dedup.OutcomeLate, f.outcome(t, b5.ID))
	require.Equal(t, 0.0, f.metric(t, "eventline_consumer_events_stale_total"), "nothing discarded as stale")
	require.Equal(t, []int64{1, 2}, f.versions(t, "a"))
	require.Empty(t, log.of(a2.ID), "not applied out of order")

	// The operator applies one, marked late, and discards the other.
	_, err = admin.ReplayHeld(ctx, f.env.Pool, f.env.Schema, admin.HeldFilter{IDs: []int64{held[0].ID}})
	require.NoError(t, err)
	_, err = f.el.SweepResult(ctx)
	require.NoError(t, err)
	require.Equal(t, []bool{true}, log.of(a2.ID))
	ids, err := admin.DiscardHeld(ctx, f.env.Pool, f.env.Schema, admin.HeldFilter{IDs: []int64{held[1].ID}}, "not genuine")
	require.NoError(t, err)
	require.Equal(t, []int64{held[1].ID}, ids)
}
