package middleware_test

// Held events: late events held for the operator and applied or discarded
// on request, and dead letters replayed on request.

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/versioning"
)

// lateLog records, per event id, the IsLate flag of each handler call.
type lateLog struct {
	mu    sync.Mutex
	calls map[string][]bool
}

func (l *lateLog) observe(ctx context.Context, e eventline.Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls[e.ID] = append(l.calls[e.ID], middleware.IsLate(ctx))
}

func (l *lateLog) of(id string) []bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.calls[id]
}

// A version given up on after the park timeout that arrives later (a
// relay dead letter replayed too late, a slow delivery) is held for the
// operator, counted and listed, never silently discarded; its dedup row
// makes redeliveries duplicates but does not block the operator's apply,
// which runs the handler marked late. Before: it was stale, its handler
// never ran and its dedup row blocked every later attempt.
func TestLateEventIsHeldThenAppliedOnRequest(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{ParkTimeout: time.Nanosecond})
	log := &lateLog{calls: map[string][]bool{}}
	f.observe = log.observe
	ctx := context.Background()
	for _, v := range []int64{1, 3} {
		require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", v))))
	}
	res, err := f.el.SweepResult(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.GapsSkipped, "v2 given up after the park timeout")
	require.Equal(t, []int64{1, 3}, f.versions(t, "a"))

	late := consumertest.Message(t, consumertest.Event("a", 2))
	require.NoError(t, f.deliver(t, late))
	require.NoError(t, f.deliver(t, late), "a redelivery of a held event is a duplicate")
	require.Empty(t, log.of(late.UUID), "a late event is not applied out of order by default")
	require.Equal(t, dedup.OutcomeLate, f.outcome(t, late.UUID))
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_late_events_total"))
	require.Equal(t, 0.0, f.metric(t, "eventline_consumer_events_stale_total"))

	held, err := admin.ListHeld(ctx, f.env.Pool, f.env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: group})
	require.NoError(t, err)
	require.Len(t, held, 1)
	require.Equal(t, late.UUID, held[0].EventID)
	require.Equal(t, "arrived_late", held[0].Cause)
	require.Contains(t, held[0].Reason, "park timeout")
	require.EqualValues(t, 3, held[0].CurrentVersion)
	require.Equal(t, []byte(late.Payload), held[0].Payload)
	require.Equal(t, map[string]string(late.Metadata), held[0].Metadata, "the message whole")

	// The operator replays it: the sweeper runs the handler, marked late.
	replay, err := admin.ReplayHeld(ctx, f.env.Pool, f.env.Schema, admin.HeldFilter{IDs: []int64{held[0].ID}})
	require.NoError(t, err)
	require.Equal(t, []int64{held[0].ID}, replay.Requested)
	res, err = f.el.SweepResult(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.LateApplied)
	require.Equal(t, []bool{true}, log.of(late.UUID), "the handler ran once, told the event is late")
	require.Equal(t, dedup.OutcomeLateApplied, f.outcome(t, late.UUID))
	require.Equal(t, []int64{1, 3, 2}, f.versions(t, "a"))
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_late_applied_total"))
	held, err = admin.ListHeld(ctx, f.env.Pool, f.env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: group})
	require.NoError(t, err)
	require.Empty(t, held, "replayed, no longer open")
	require.NoError(t, f.deliver(t, late))
	require.Equal(t, []bool{true}, log.of(late.UUID), "still a duplicate afterwards")
}

// An operator may discard a late event instead; it stays a duplicate.
func TestLateEventCanBeDiscarded(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{ParkTimeout: time.Nanosecond})
	ctx := context.Background()
	for _, v := range []int64{1, 3} {
		require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", v))))
	}
	_, err := f.el.SweepResult(ctx)
	require.NoError(t, err)
	late := consumertest.Message(t, consumertest.Event("a", 2))
	require.NoError(t, f.deliver(t, late))
	ids, err := admin.DiscardHeld(ctx, f.env.Pool, f.env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: group}, "not needed")
	require.NoError(t, err)
	require.Len(t, ids, 1)
	require.Equal(t, dedup.OutcomeLateDiscarded, f.outcome(t, late.UUID))
	require.NoError(t, f.deliver(t, late))
	require.Equal(t, []int64{1, 3}, f.versions(t, "a"))
	_, err = f.el.SweepResult(ctx)
	require.NoError(t, err)
	require.Equal(t, 0.0, f.metric(t, "eventline_consumer_late_events"), "the gauge counts held late events")
}

// Under ApplyLate (per event type) a late event is applied at once, its
// handler told; other types stay held. A stale event whose version was not
// skipped (an old version under a new id) is still discarded.
func TestLatePolicyApplyRunsTheHandlerMarkedLate(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{GapPolicy: versioning.Apply,
		LatePolicyByType: map[string]versioning.LatePolicy{"thing.changed": versioning.ApplyLate}})
	log := &lateLog{calls: map[string][]bool{}}
	f.observe = log.observe
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 4))), "jumps, skipping 2..3")

	late := consumertest.Message(t, consumertest.Event("a", 2))
	require.NoError(t, f.deliver(t, late))
	require.Equal(t, []bool{true}, log.of(late.UUID))
	require.Equal(t, dedup.OutcomeLateApplied, f.outcome(t, late.UUID))

	other := consumertest.Event("a", 3)
	other.Type = "thing.renamed"
	held := consumertest.Message(t, other)
	require.NoError(t, f.deliver(t, held))
	require.Empty(t, log.of(held.UUID))
	require.Equal(t, dedup.OutcomeLate, f.outcome(t, held.UUID))

	stale := consumertest.Message(t, consumertest.Event("a", 1))
	require.NoError(t, f.deliver(t, stale))
	require.Empty(t, log.of(stale.UUID))
	require.Equal(t, dedup.OutcomeStale, f.outcome(t, stale.UUID))
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_events_stale_total"))
}

// The predecessor rule: an event applies once its aggregate is at the
// version it follows (aggregate_previous_version), so sparse versions are
// no gap, and parked successors drain by the same rule. Before: v5
// following v1 parked behind "missing" 2..4 until the park timeout skipped
// them.
func TestSparseVersionsFollowTheirPredecessor(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{ParkTimeout: time.Hour})
	sparse := func(v, prev int64) *message.Message {
		e := consumertest.Event("a", v)
		e.PreviousVersion = prev
		return consumertest.Message(t, e)
	}
	require.NoError(t, f.deliver(t, sparse(1, 0)))
	require.NoError(t, f.deliver(t, sparse(5, 1)))
	require.Equal(t, []int64{1, 5}, f.versions(t, "a"), "v5 follows v1: no gap")
	require.NoError(t, f.deliver(t, sparse(20, 9)), "follows v9, which is missing: parked")
	require.Equal(t, 1, f.count(t, "parked_events"))
	require.NoError(t, f.deliver(t, sparse(9, 5)), "follows v5: applies, and v20 drains after it")
	require.Equal(t, []int64{1, 5, 9, 20}, f.versions(t, "a"))
	require.Equal(t, 0, f.count(t, "parked_events"))
	skipped, err := f.el.Store().ListSkipped(context.Background(), f.env.Pool, store.SkippedFilter{Group: group})
	require.NoError(t, err)
	require.Empty(t, skipped, "nothing was missing")
}

// A parked event the aggregate passes (here: an event of an Apply-policy
// type jumps over it) is moved to the late events, not dropped as stale.
func TestParkedEventPassedByAJumpIsHeldAsLate(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{PolicyByType: map[string]versioning.GapPolicy{"thing.jumped": versioning.Apply}})
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	parked := consumertest.Message(t, consumertest.Event("a", 3))
	require.NoError(t, f.deliver(t, parked))
	jump := consumertest.Event("a", 5)
	jump.Type = "thing.jumped"
	require.NoError(t, f.deliver(t, consumertest.Message(t, jump)))
	require.Equal(t, []int64{1, 5}, f.versions(t, "a"))
	require.Equal(t, 0, f.count(t, "parked_events"))
	late, err := admin.ListHeld(context.Background(), f.env.Pool, f.env.Schema, admin.HeldFilter{Kind: admin.HeldLate, Group: group})
	require.NoError(t, err)
	require.Len(t, late, 1)
	require.Equal(t, parked.UUID, late[0].EventID)
	require.Equal(t, "arrived_late", late[0].Cause, "its version is in the jump's skipped range")
	require.Equal(t, dedup.OutcomeLate, f.outcome(t, parked.UUID))
}

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
