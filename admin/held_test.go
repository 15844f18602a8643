package admin_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/versioning"
)

// envelope is a forwarder envelope as the producer writes it into the
// outbox, for a relay dead letter.
const envelope = `{"destination_topic":"orders","uuid":"m-1","payload":"e30=","metadata":{"event_id":"e-1"}}`

// relayDeadLetter holds an outbox row of shard as the relay does when it
// gives up on it, with event e's identity, and returns its id.
func (b bundle) relayDeadLetter(t *testing.T, shard int, uuid string, e eventline.Event) int64 {
	t.Helper()
	require.NoError(t, held.New(b.env.Schema).AddRelay(b.ctx, b.env.Pool, held.Event{
		Cause: held.CauseRetriesExhausted, Reason: "gave up after 5 attempts: boom", Shard: shard, MessageUUID: uuid,
		EventID: e.ID, EventType: e.Type, AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion,
		Topic: "orders", Payload: []byte(envelope), Metadata: map[string]string{"k": "v"}, Attempts: 5, LastError: "boom",
	}))
	list, err := admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter, Statuses: []admin.HeldStatus{admin.StatusHeld}})
	require.NoError(t, err)
	for _, h := range list {
		if h.MessageUUID == uuid {
			return h.ID
		}
	}
	t.Fatalf("relay dead letter %s not listed", uuid)
	return 0
}

func order(id string, version int64) eventline.Event {
	return eventline.Event{ID: "e-" + id, Type: "order.created", AggregateType: "order", AggregateID: id, AggregateVersion: version}
}

// TestListHeld: held events are listed oldest first with everything they
// keep, filtered by kind, group, aggregate, ids and status, the open ones
// by default.
func TestListHeld(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	first := b.relayDeadLetter(t, 1, "u-1", order("o-1", 1))
	second := b.relayDeadLetter(t, 0, "u-2", order("o-2", 3))

	list, err := admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{})
	require.NoError(t, err)
	require.Len(t, list, 2)
	h := list[0]
	require.Equal(t, []any{first, admin.HeldRelayDeadLetter, "retries_exhausted", "", 1, "u-1", "e-o-1", "order/o-1", int64(1), "orders", 5, "boom", admin.StatusHeld},
		[]any{h.ID, h.Kind, h.Cause, h.Group, h.Shard, h.MessageUUID, h.EventID, h.AggregateType + "/" + h.AggregateID, h.AggregateVersion, h.Topic, h.Attempts, h.LastError, h.Status})
	require.Equal(t, envelope, string(h.Payload), "the outbox row, byte for byte")
	require.Equal(t, map[string]string{"k": "v"}, h.Metadata)
	require.Equal(t, "gave up after 5 attempts: boom", h.Reason)
	require.Equal(t, 1, h.Times)
	require.Nil(t, h.ReplayedAt)

	for name, tc := range map[string]struct {
		f    admin.HeldFilter
		want []int64
	}{
		"by kind":          {admin.HeldFilter{Kind: admin.HeldRelayDeadLetter}, []int64{first, second}},
		"by another kind":  {admin.HeldFilter{Kind: admin.HeldLate}, nil},
		"by aggregate":     {admin.HeldFilter{AggregateType: "order", AggregateID: "o-2"}, []int64{second}},
		"by id":            {admin.HeldFilter{IDs: []int64{second, second + 100}}, []int64{second}},
		"by group":         {admin.HeldFilter{Group: "billing"}, nil},
		"capped by Limit":  {admin.HeldFilter{Limit: 1}, []int64{first}},
		"by a status":      {admin.HeldFilter{Statuses: []admin.HeldStatus{admin.StatusReplayed}}, nil},
		"by every status":  {admin.HeldFilter{Statuses: []admin.HeldStatus{admin.StatusHeld, admin.StatusDiscarded}}, []int64{first, second}},
		"every filter set": {admin.HeldFilter{Kind: admin.HeldRelayDeadLetter, AggregateType: "order", AggregateID: "o-1", IDs: []int64{first}}, []int64{first}},
	} {
		list, err := admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, tc.f)
		require.NoError(t, err, name)
		var ids []int64
		for _, h := range list {
			ids = append(ids, h.ID)
		}
		require.Equal(t, tc.want, ids, name)
	}

	_, err = admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Kind: "parked"})
	require.ErrorContains(t, err, `admin.ListHeld: HeldFilter.Kind "parked" is unknown`)
	_, err = admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Statuses: []admin.HeldStatus{"dead"}})
	require.ErrorContains(t, err, `admin.ListHeld: HeldFilter.Statuses: "dead" is unknown`)
}

// TestReplayHeld: a relay dead letter is re-enqueued into its shard with
// its envelope, once, per aggregate in version order, and the groups that
// already gave up on its version are named.
func TestReplayHeld(t *testing.T) {
	t.Parallel()

	t.Run("a relay dead letter goes back into its outbox shard, once", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 2)
		id := b.relayDeadLetter(t, 1, "u-1", order("o-1", 1))

		_, err := admin.ReplayHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{IDs: []int64{id + 1}})
		require.ErrorIs(t, err, admin.ErrNoHeld, "an unknown id replays nothing")
		res, err := admin.ReplayHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{IDs: []int64{id}})
		require.NoError(t, err)
		require.Equal(t, []int64{id}, res.Enqueued)
		require.Empty(t, res.Requested)
		require.Empty(t, res.ArrivesLate)
		require.Equal(t, 1, pgtest.Count(t, b.env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(b.env.Schema, outbox.Table(1))+
			` WHERE uuid = 'u-1' AND payload::text = $1 AND metadata->>'k' = 'v'`, envelope), "re-enqueued into its shard with its envelope")
		_, err = admin.ReplayHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter})
		require.ErrorIs(t, err, admin.ErrNoHeld, "a dead letter is replayed once")

		list, err := admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{})
		require.NoError(t, err)
		require.Empty(t, list)
		list, err = admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Statuses: []admin.HeldStatus{admin.StatusReplayed}})
		require.NoError(t, err)
		require.Len(t, list, 1)
		require.NotNil(t, list[0].ReplayedAt)
	})

	t.Run("per aggregate in version order, naming the groups that skipped a version", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 1)
		v3 := b.relayDeadLetter(t, 0, "u-3", order("o-1", 3))
		v2 := b.relayDeadLetter(t, 0, "u-2", order("o-1", 2))
		other := b.relayDeadLetter(t, 0, "u-9", order("o-2", 1))
		for _, g := range []string{"shipping", "billing"} {
			require.NoError(t, b.vs.RecordSkipped(b.ctx, b.env.Pool, versioning.Key{Group: g, AggregateType: "order", AggregateID: "o-1"}, 2, 2, "park timeout"))
		}
		res, err := admin.ReplayHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter})
		require.NoError(t, err)
		require.Equal(t, []int64{v2, v3, other}, res.Enqueued, "o-1's v2 before its v3")
		require.Equal(t, []admin.LateArrival{{ID: v2, EventID: "e-o-1", AggregateType: "order", AggregateID: "o-1", AggregateVersion: 2,
			Groups: []string{"billing", "shipping"}}}, res.ArrivesLate)
		rows, err := b.env.Pool.Query(b.ctx, `SELECT uuid::text FROM `+sqlident.Qualify(b.env.Schema, outbox.Table(0))+` ORDER BY "offset"`)
		require.NoError(t, err)
		uuids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.Equal(t, []string{"u-2", "u-3", "u-9"}, uuids, "enqueued in that order")
	})
}

// TestDiscardHeld: an open held event is given up with a reason (which
// is required), kept listed as discarded, and never replayed.
func TestDiscardHeld(t *testing.T) {
	t.Parallel()
	b := setup(t, 1)
	id := b.relayDeadLetter(t, 0, "u-1", order("o-1", 1))
	keep := b.relayDeadLetter(t, 0, "u-2", order("o-2", 1))

	_, err := admin.DiscardHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{IDs: []int64{id}}, "  ")
	require.ErrorContains(t, err, "admin.DiscardHeld: reason is empty")
	ids, err := admin.DiscardHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{IDs: []int64{id}}, "superseded by o-1 v2")
	require.NoError(t, err)
	require.Equal(t, []int64{id}, ids)
	_, err = admin.DiscardHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{IDs: []int64{id}}, "again")
	require.ErrorIs(t, err, admin.ErrNoHeld, "discarded once")
	_, err = admin.ReplayHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{IDs: []int64{id}})
	require.ErrorIs(t, err, admin.ErrNoHeld, "a discarded event is never replayed")

	list, err := admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Statuses: []admin.HeldStatus{admin.StatusDiscarded}})
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, "superseded by o-1 v2", list[0].DiscardReason)
	require.NotNil(t, list[0].DiscardedAt)
	list, err = admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{})
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, keep, list[0].ID)
}
