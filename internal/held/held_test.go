package held_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
)

type bundle struct {
	ctx   context.Context
	env   pgtest.Env
	store *held.Store
}

func setup(t *testing.T) bundle {
	t.Helper()
	env := pgtest.New(t, pgtest.Options{Shards: 1, MaxConns: 4})
	return bundle{ctx: context.Background(), env: env, store: held.New(env.Schema)}
}

// deadLetter holds a record of group at offset of aggregate id, version v.
func (b bundle) deadLetter(t *testing.T, group string, offset int64, id string, v int64) int64 {
	t.Helper()
	n, err := b.store.AddDeadLetter(b.ctx, b.env.Pool, held.Event{Group: group, Topic: "orders", Handler: "h", FromKafka: true, Offset: offset,
		MessageUUID: "m", EventID: "e-" + id, AggregateType: "order", AggregateID: id, AggregateVersion: v, Cause: held.CausePermanent, Reason: "r"})
	require.NoError(t, err)
	return n
}

// late holds event e-id of aggregate order/id at version v as late for
// group, with its dedup record, as the gate does.
func (b bundle) late(t *testing.T, group, id string, v int64) int64 {
	t.Helper()
	var n int64
	err := b.env.Pool.QueryRow(b.ctx, sqlident.SQL(b.env.Schema, `WITH h AS (
			INSERT INTO {schema}.held_events (kind, cause, reason, consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version,
				message_uuid, payload, header_keys, header_values)
			VALUES ('late', 'arrived_late', 'r', $1, 'e-' || $2 || '-' || $3::bigint, 'order', $2, $3::bigint, '', '', '{}', '{}') RETURNING id
		), p AS (
			INSERT INTO {schema}.processed_events (consumer_group, event_id, aggregate_type, aggregate_id, aggregate_version, outcome)
			VALUES ($1, 'e-' || $2 || '-' || $3::bigint, 'order', $2, $3::bigint, 'late')
		) SELECT id FROM h`), group, id, v).Scan(&n)
	require.NoError(t, err)
	return n
}

func ids(events []held.Event) []int64 {
	out := make([]int64, len(events))
	for i, e := range events {
		out[i] = e.ID
	}
	return out
}

func TestStore(t *testing.T) {
	t.Parallel()

	t.Run("a dead letter is kept byte for byte, and a redelivered record re-opens its row", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		e := held.Event{Group: "billing", Topic: "orders", Handler: "h", FromKafka: true, Partition: 2, Offset: 40, Key: []byte{0, 1},
			MessageUUID: "m\x00", Payload: []byte{0xff, 0}, Metadata: map[string]string{"k\xff": "v\x00"},
			EventID: "e", AggregateType: "order", AggregateID: "o", AggregateVersion: 3, PreviousVersion: 2, Cause: held.CauseRetriesExhausted, Reason: "boom"}
		id, err := b.store.AddDeadLetter(b.ctx, b.env.Pool, e)
		require.NoError(t, err)
		list, err := b.store.List(b.ctx, b.env.Pool, held.Filter{})
		require.NoError(t, err)
		require.Len(t, list, 1)
		got := list[0]
		require.Equal(t, []any{id, held.KindDeadLetter, held.StatusHeld, 1, "m\x00", []byte{0xff, 0}, map[string]string{"k\xff": "v\x00"}, []byte{0, 1}, int32(2), int64(40), int64(2)},
			[]any{got.ID, got.Kind, got.Status, got.Times, got.MessageUUID, got.Payload, got.Metadata, got.Key, got.Partition, got.Offset, got.PreviousVersion})

		require.NoError(t, b.store.MarkRequested(b.ctx, b.env.Pool, id))
		e.Cause, e.Reason = held.CausePermanent, "again"
		again, err := b.store.AddDeadLetter(b.ctx, b.env.Pool, e)
		require.NoError(t, err)
		require.Equal(t, id, again, "the same record, the same row")
		list, err = b.store.List(b.ctx, b.env.Pool, held.Filter{})
		require.NoError(t, err)
		require.Equal(t, []any{held.StatusHeld, 2, held.CausePermanent, "again"}, []any{list[0].Status, list[0].Times, list[0].Cause, list[0].Reason})

		e.FromKafka = false
		other, err := b.store.AddDeadLetter(b.ctx, b.env.Pool, e)
		require.NoError(t, err)
		require.NotEqual(t, id, other, "a message not from Kafka never conflicts")
		_, err = b.store.AddDeadLetter(b.ctx, b.env.Pool, held.Event{MessageUUID: "m"})
		require.ErrorContains(t, err, "without a consumer group")
	})

	// A dead letter whose aggregate holds a NUL byte or invalid UTF-8 (a
	// hostile record) is stored with those bytes cleaned in its text
	// columns; an operator selecting it by the aggregate it claimed finds
	// it, and can discard it, instead of getting SQLSTATE 22021.
	t.Run("dead letters of hostile aggregates can be selected", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		for _, agg := range []string{"a\x00b", "caf\xc3", "plain"} {
			_, err := b.store.AddDeadLetter(b.ctx, b.env.Pool, held.Event{Group: "g\x00", AggregateType: "t\xff", AggregateID: agg, MessageUUID: agg,
				Metadata: map[string]string{"aggregate_id": agg}, Cause: held.CausePermanent, Reason: "bad"})
			require.NoError(t, err)
		}
		for _, agg := range []string{"a\x00b", "caf\xc3", "plain"} {
			f := held.Filter{Group: "g\x00", AggregateType: "t\xff", AggregateID: agg}
			dead, err := b.store.List(b.ctx, b.env.Pool, f)
			require.NoError(t, err, "%q", agg)
			require.Len(t, dead, 1, "%q", agg)
			require.Equal(t, agg, dead[0].MessageUUID, "the bytes are kept")
			require.Equal(t, agg, dead[0].Metadata["aggregate_id"])
			require.NoError(t, pgx.BeginFunc(b.ctx, b.env.Pool, func(tx pgx.Tx) error {
				locked, err := b.store.Lock(b.ctx, tx, f)
				require.Equal(t, ids(dead), ids(locked))
				return err
			}))
			n, err := b.store.Discard(b.ctx, b.env.Pool, f, "hostile record")
			require.NoError(t, err, "%q", agg)
			require.Equal(t, []int64{dead[0].ID}, n)
		}
	})

	t.Run("a consumer claims its group's requested replays per aggregate in version order, skipping locked rows", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		x3 := b.deadLetter(t, "billing", 1, "x", 3)
		y1 := b.deadLetter(t, "billing", 2, "y", 1)
		x2 := b.deadLetter(t, "billing", 3, "x", 2)
		held4 := b.deadLetter(t, "billing", 4, "x", 4)
		other := b.deadLetter(t, "shipping", 1, "x", 1)
		require.NoError(t, b.store.MarkRequested(b.ctx, b.env.Pool, x3, y1, x2, other))

		id, v, found, err := b.store.EarlierHeld(b.ctx, b.env.Pool, held.Event{ID: held4, Group: "billing", Kind: held.KindDeadLetter, AggregateType: "order", AggregateID: "x", AggregateVersion: 4})
		require.NoError(t, err)
		require.False(t, found, "the earlier ones are requested, not held: %d v%d", id, v)
		later := b.deadLetter(t, "billing", 5, "x", 5)
		id, v, found, err = b.store.EarlierHeld(b.ctx, b.env.Pool, held.Event{ID: later, Group: "billing", Kind: held.KindDeadLetter, AggregateType: "order", AggregateID: "x", AggregateVersion: 5})
		require.NoError(t, err)
		require.True(t, found)
		require.Equal(t, []int64{held4, 4}, []int64{id, v})

		tx, err := b.env.Pool.Begin(b.ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(b.ctx) }()
		claimed, err := b.store.Claim(b.ctx, tx, "billing", held.KindDeadLetter, 2)
		require.NoError(t, err)
		require.Equal(t, []int64{x2, x3}, ids(claimed), "x's versions in order, at most 2")
		tx2, err := b.env.Pool.Begin(b.ctx)
		require.NoError(t, err)
		defer func() { _ = tx2.Rollback(b.ctx) }()
		rest, err := b.store.Claim(b.ctx, tx2, "billing", held.KindDeadLetter, 10)
		require.NoError(t, err)
		require.Equal(t, []int64{y1}, ids(rest), "rows another replayer holds are skipped")
		none, err := b.store.Claim(b.ctx, tx2, "billing", held.KindLate, 10)
		require.NoError(t, err)
		require.Empty(t, none, "one kind at a time")

		require.NoError(t, b.store.MarkReplayed(b.ctx, tx, x2))
		require.NoError(t, b.store.MarkReplayFailed(b.ctx, tx, x3, "still failing", 0, true))
		require.NoError(t, tx.Commit(b.ctx))
		list, err := b.store.List(b.ctx, b.env.Pool, held.Filter{IDs: []int64{x2, x3}, Statuses: []held.Status{held.StatusHeld, held.StatusReplayed}})
		require.NoError(t, err)
		require.Equal(t, []int64{x3, x2}, ids(list), "oldest first")
		require.Equal(t, []any{held.StatusHeld, 1, "still failing", held.StatusReplayed}, []any{list[0].Status, list[0].Attempts, list[0].LastError, list[1].Status})
		require.NotNil(t, list[1].ReplayedAt)
	})

	t.Run("late events are applied per aggregate on request, with backoff, and given up", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		a2 := b.late(t, "billing", "a", 2)
		a1 := b.late(t, "billing", "a", 1)
		c1 := b.late(t, "billing", "c", 1)
		_ = b.late(t, "billing", "d", 1) // not requested
		require.NoError(t, b.store.MarkRequested(b.ctx, b.env.Pool, a2, a1, c1))

		aggs, err := b.store.LateAggregates(b.ctx, b.env.Pool, "billing", 10)
		require.NoError(t, err)
		require.ElementsMatch(t, []held.Aggregate{{Type: "order", ID: "a"}, {Type: "order", ID: "c"}}, aggs)
		require.NoError(t, pgx.BeginFunc(b.ctx, b.env.Pool, func(tx pgx.Tx) error {
			late, err := b.store.LockLate(b.ctx, tx, "billing", held.Aggregate{Type: "order", ID: "a"}, 10)
			require.Equal(t, []int64{a1, a2}, ids(late), "in version order")
			require.NoError(t, b.store.MarkLateApplied(b.ctx, tx, a1))
			require.NoError(t, b.store.MarkReplayFailed(b.ctx, tx, a2, "handler failed", time.Hour, false))
			require.NoError(t, b.store.MarkReplayFailed(b.ctx, tx, c1, "handler failed", 0, true))
			return err
		}))
		aggs, err = b.store.LateAggregates(b.ctx, b.env.Pool, "billing", 10)
		require.NoError(t, err)
		require.Empty(t, aggs, "a2 waits an hour, c1 was given up")
		var outcome string
		require.NoError(t, b.env.Pool.QueryRow(b.ctx, sqlident.SQL(b.env.Schema, `SELECT outcome FROM {schema}.processed_events WHERE event_id = 'e-a-1'`)).Scan(&outcome))
		require.Equal(t, "late_applied", outcome)
		list, err := b.store.List(b.ctx, b.env.Pool, held.Filter{Kind: held.KindLate, IDs: []int64{a2, c1}})
		require.NoError(t, err)
		require.Equal(t, []any{held.StatusReplayRequested, 1, true}, []any{list[0].Status, list[0].Attempts, list[0].NextAttemptAt != nil})
		require.Equal(t, []any{held.StatusHeld, 1, "handler failed"}, []any{list[1].Status, list[1].Attempts, list[1].LastError})
		n, err := b.store.CountOpen(b.ctx, b.env.Pool, "billing", held.KindLate)
		require.NoError(t, err)
		require.EqualValues(t, 3, n, "a2, c1 and d1: open; a1 replayed")

		// A new request starts the attempts afresh.
		require.NoError(t, b.store.MarkRequested(b.ctx, b.env.Pool, c1))
		list, err = b.store.List(b.ctx, b.env.Pool, held.Filter{IDs: []int64{c1}})
		require.NoError(t, err)
		require.Equal(t, []any{held.StatusReplayRequested, 0}, []any{list[0].Status, list[0].Attempts})
	})

	t.Run("the relay's dead letter keeps the outbox row", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.NoError(t, b.store.AddRelay(b.ctx, b.env.Pool, held.Event{Cause: held.CauseRejected, Reason: "too large", Shard: 0, MessageUUID: "u-1",
			EventID: "e", AggregateType: "order", AggregateID: "o", AggregateVersion: 1, Topic: "orders",
			Payload: []byte(`{"uuid":"e"}`), Metadata: map[string]string{"a": "b"}, Attempts: 1, LastError: "kafka: too large"}))
		n, err := b.store.CountOpen(b.ctx, b.env.Pool, "", held.KindRelayDeadLetter)
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
		list, err := b.store.List(b.ctx, b.env.Pool, held.Filter{Kind: held.KindRelayDeadLetter})
		require.NoError(t, err)
		require.Len(t, list, 1)
		got := list[0]
		require.Equal(t, []any{"", "u-1", `{"uuid":"e"}`, map[string]string{"a": "b"}, 1, "kafka: too large", false},
			[]any{got.Group, got.MessageUUID, string(got.Payload), got.Metadata, got.Attempts, got.LastError, got.FromKafka})
		require.NotNil(t, got.LastAttemptAt)
	})
}
