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
	"github.com/eventline/eventline/internal/store"
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

// deadLetter holds a message group gave up on, as the consumer does, and
// returns its id.
func (b bundle) deadLetter(t *testing.T, group string, offset int64, e eventline.Event) int64 {
	t.Helper()
	id, err := held.New(b.env.Schema).AddDeadLetter(b.ctx, b.env.Pool, held.Event{
		Group: group, Topic: "orders", Handler: "orders", FromKafka: true, Partition: 0, Offset: offset,
		MessageUUID: "m-" + e.ID, Payload: []byte(`{"n":1}`), Metadata: map[string]string{"event_id": e.ID, "bin\x00": "\xff"},
		EventID: e.ID, EventType: e.Type, AggregateType: e.AggregateType, AggregateID: e.AggregateID, AggregateVersion: e.AggregateVersion,
		Cause: held.CausePermanent, Reason: "no handler",
	})
	require.NoError(t, err)
	return id
}

// late holds e as a late event of group (its dedup record says late), as
// the version gate does, and returns its id.
func (b bundle) late(t *testing.T, group string, e eventline.Event) int64 {
	t.Helper()
	var id int64
	err := b.env.Pool.QueryRow(b.ctx, sqlident.SQL(b.env.Schema, `WITH h AS (
			INSERT INTO {schema}.held_events (kind, cause, reason, consumer_group, event_id, event_type, aggregate_type, aggregate_id,
				aggregate_version, previous_version, current_version, message_uuid, payload, header_keys, header_values)
			VALUES ('late', 'arrived_late', 'park timeout', $1, $2, $3, $4, $5, $6::bigint, $6::bigint - 1, $6::bigint + 1, convert_to($2, 'UTF8'), '{}', '{}', '{}')
			RETURNING id
		), p AS (
			INSERT INTO {schema}.processed_events (consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, outcome)
			VALUES ($1, $2, $4, $5, $6::bigint, 'late')
		) SELECT id FROM h`), group, e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion).Scan(&id)
	require.NoError(t, err)
	return id
}

// outcome returns group's dedup outcome for e.
func (b bundle) outcome(t *testing.T, group string, e eventline.Event) string {
	t.Helper()
	var o string
	require.NoError(t, b.env.Pool.QueryRow(b.ctx, sqlident.SQL(b.env.Schema, `SELECT outcome FROM {schema}.processed_events
		WHERE consumer_group = $1 AND event_id = $2 AND aggregate_type = $3 AND aggregate_id = $4`), group, e.ID, e.AggregateType, e.AggregateID).Scan(&o))
	return o
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

	dl := b.deadLetter(t, "billing", 7, order("o-3", 2))
	late := b.late(t, "shipping", order("o-4", 5))
	list, err = admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Group: "billing"})
	require.NoError(t, err)
	require.Len(t, list, 1)
	h = list[0]
	require.Equal(t, []any{dl, admin.HeldDeadLetter, "permanent", "no handler", "billing", "orders", "orders", true, int32(0), int64(7), "m-e-o-3"},
		[]any{h.ID, h.Kind, h.Cause, h.Reason, h.Group, h.Topic, h.Handler, h.FromKafka, h.Partition, h.Offset, h.MessageUUID})
	require.Equal(t, map[string]string{"event_id": "e-o-3", "bin\x00": "\xff"}, h.Metadata, "headers byte for byte")
	list, err = admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Kind: admin.HeldLate})
	require.NoError(t, err)
	require.Len(t, list, 1)
	h = list[0]
	require.Equal(t, []any{late, "shipping", "arrived_late", int64(5), int64(4), int64(6)},
		[]any{h.ID, h.Group, h.Cause, h.AggregateVersion, h.PreviousVersion, h.CurrentVersion})

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
			require.NoError(t, b.vs.RecordSkipped(b.ctx, b.env.Pool, store.Key{Group: g, AggregateType: "order", AggregateID: "o-1"}, 2, 2, "park timeout"))
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

	t.Run("consumer dead letters and late events wait for a running consumer of their group", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 1)
		relay := b.relayDeadLetter(t, 0, "u-1", order("o-1", 1))
		dl2 := b.deadLetter(t, "billing", 2, order("o-2", 2))
		dl1 := b.deadLetter(t, "billing", 1, order("o-2", 1))
		late := b.late(t, "billing", order("o-3", 4))
		other := b.deadLetter(t, "shipping", 1, order("o-2", 1))

		res, err := admin.ReplayHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Group: "billing"})
		require.NoError(t, err)
		require.Empty(t, res.Enqueued, "the relay's have no group")
		require.Equal(t, []int64{dl1, dl2, late}, res.Requested, "per aggregate in version order")
		list, err := admin.ListHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Statuses: []admin.HeldStatus{admin.StatusReplayRequested}})
		require.NoError(t, err)
		require.Len(t, list, 3)
		for _, h := range list {
			require.NotNil(t, h.ReplayRequestedAt)
			require.Nil(t, h.ReplayedAt, "replayed by the consumer, not here")
		}
		_, err = admin.ReplayHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{IDs: []int64{dl1}})
		require.ErrorIs(t, err, admin.ErrNoHeld, "a requested replay is not requested again")

		res, err = admin.ReplayHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{IDs: []int64{relay, other}})
		require.NoError(t, err)
		require.Equal(t, []int64{relay}, res.Enqueued)
		require.Equal(t, []int64{other}, res.Requested, "one call replays every kind")
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

	// A late event's dedup record says late_discarded, so a redelivery
	// stays a duplicate; a replay-requested dead letter can be discarded
	// too; the filter selects.
	lateEvent := order("o-5", 3)
	late := b.late(t, "billing", lateEvent)
	dl := b.deadLetter(t, "billing", 1, order("o-6", 1))
	_, err = admin.ReplayHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{IDs: []int64{dl}})
	require.NoError(t, err)
	_, err = admin.DiscardHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Group: "shipping"}, "no such group")
	require.ErrorIs(t, err, admin.ErrNoHeld)
	ids, err = admin.DiscardHeld(b.ctx, b.env.Pool, b.env.Schema, admin.HeldFilter{Group: "billing"}, "obsolete")
	require.NoError(t, err)
	require.Equal(t, []int64{late, dl}, ids)
	require.Equal(t, "late_discarded", b.outcome(t, "billing", lateEvent))
}
