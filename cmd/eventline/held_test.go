package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/middleware"
)

// heldJSONTest mirrors the documented JSON of `held list -json`.
type heldJSONTest struct {
	ID               int64      `json:"id"`
	Kind             string     `json:"kind"`
	Cause            string     `json:"cause"`
	Group            string     `json:"group"`
	Shard            *int       `json:"shard"`
	EventID          string     `json:"event_id"`
	AggregateID      string     `json:"aggregate_id"`
	AggregateVersion int64      `json:"aggregate_version"`
	Topic            string     `json:"topic"`
	Attempts         int        `json:"attempts"`
	LastError        string     `json:"last_error"`
	Reason           string     `json:"reason"`
	HeldAt           time.Time  `json:"held_at"`
	Status           string     `json:"status"`
	ReplayedAt       *time.Time `json:"replayed_at"`
	DiscardReason    string     `json:"discard_reason"`
}

func TestHeld(t *testing.T) {
	t.Parallel()

	// A relay dead-letters an event whose topic does not exist; it is listed,
	// the topic is created, and the replayed event arrives with its original
	// id.
	t.Run("relay dead letter through the relay", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 2, 2)
		env, brokers, topic, missing := b.env, b.brokers, b.topic, kafkatest.Topic(t, "missing")
		good := publish(t, env, topic, "A")
		lost := publish(t, env, missing, "L")[0] // its topic does not exist yet (one aggregate, one topic: another aggregate)
		later := publish(t, env, topic, "A")

		relay := start(t, b.relayArgs("-backoff-initial", "10ms", "-backoff-max", "20ms", "-max-attempts", "2")...)

		var dls []heldJSONTest
		require.Eventually(t, func() bool {
			var out, errw syncBuffer
			if runWithEnv(context.Background(), append(dbArgs(env.Schema), "held", "list", "-json"), &out, &errw, noEnv) != 0 {
				return false
			}
			return jsonUnmarshal(out.String(), &dls) == nil && len(dls) == 1
		}, time.Minute, 50*time.Millisecond, "the event to a missing topic is dead-lettered")
		dl := dls[0]
		require.Equal(t, "relay_dead_letter", dl.Kind)
		require.Equal(t, "retries_exhausted", dl.Cause)
		require.Empty(t, dl.Group)
		require.NotNil(t, dl.Shard)
		require.Equal(t, "held", dl.Status)
		require.Equal(t, lost.ID, dl.EventID)
		require.Equal(t, "L", dl.AggregateID)
		require.EqualValues(t, 1, dl.AggregateVersion)
		require.Equal(t, missing, dl.Topic)
		require.Equal(t, 2, dl.Attempts)
		require.Contains(t, dl.Reason, "gave up after 2 attempts")
		require.NotEmpty(t, dl.LastError)
		require.Nil(t, dl.ReplayedAt)
		seen := eventIDs(t, brokers, topic, 2)
		require.True(t, seen[good[0].ID] && seen[later[0].ID], "the shard moved on past the dead letter")

		id := strconv.FormatInt(dl.ID, 10)
		out := ok(t, env.Schema, "held", "list")
		require.Regexp(t, `ID\s+KIND\s+GROUP\s+EVENT ID\s+TYPE\s+AGGREGATE\s+VERSION\s+CAUSE\s+STATUS\s+HELD AT\s+ATTEMPTS\s+REASON`, out)
		require.Regexp(t, `(?m)^`+id+`\s+relay_dead_letter\s+-\s+`+lost.ID+`\s+order.updated\s+order/L\s+1\s+retries_exhausted\s+held\s+\S+ \S+\s+2\s+gave up`, out)
		st := okJSON[statusJSON](t, env.Schema, "status", "-json")
		require.EqualValues(t, 1, st.Outbox.DeadLetters)

		// Once the topic exists, replaying delivers the same event.
		kafkatest.CreateTopic(t, brokers, missing, 1)
		out = ok(t, env.Schema, "held", "replay", id)
		require.Contains(t, out, "re-enqueued 1 relay dead letter: "+id+"; a running relay publishes them again")
		require.True(t, eventIDs(t, brokers, missing, 1)[lost.ID], "the replayed event reached Kafka with its id")

		r := cli(t, append(dbArgs(env.Schema), "held", "replay", id)...)
		require.Equal(t, exitFailure, r.code, "a dead letter is replayed once")
		require.Contains(t, r.stderr, "none of the ids given is a held event waiting for you")
		out = ok(t, env.Schema, "held", "replay", "-kind", "relay_dead_letter", "-all")
		require.Contains(t, out, "no held events waiting for replay match")

		require.Empty(t, okJSON[[]heldJSONTest](t, env.Schema, "held", "list", "-json"))
		all := okJSON[[]heldJSONTest](t, env.Schema, "held", "list", "-status", "all", "-json")
		require.Len(t, all, 1)
		require.NotNil(t, all[0].ReplayedAt)
		require.Equal(t, "replayed", all[0].Status)
		out = ok(t, env.Schema, "held", "list", "-status", "replayed")
		require.Regexp(t, `(?m)^`+id+`\s+relay_dead_letter\s+.*\s+replayed\s+`, out)
		require.Equal(t, exitOK, relay.stop(t))
	})

	// Relay dead letters written by hand with the envelope of real outbox
	// rows, without a relay.
	t.Run("replay and discard by id and -all", func(t *testing.T) {
		t.Parallel()
		env, ctx := setup(t, 1, 0).env, context.Background()
		events := publish(t, env, "orders", "x", "y", "z")
		table := deadLetterOutbox(t, env)

		dls := okJSON[[]heldJSONTest](t, env.Schema, "held", "list", "-json", "-limit", "2")
		require.Len(t, dls, 2, "-limit caps the list")
		out := ok(t, env.Schema, "held", "list", "-limit", "2")
		require.Contains(t, out, "(first 2 shown; raise -limit for more)")
		dls = okJSON[[]heldJSONTest](t, env.Schema, "held", "list", "-json")
		require.Len(t, dls, 3)
		for i, d := range dls {
			require.Equal(t, events[i].ID, d.EventID, "oldest first")
			require.Equal(t, events[i].AggregateID, d.AggregateID)
			require.Equal(t, "orders", d.Topic)
		}

		first, unknown := strconv.FormatInt(dls[0].ID, 10), strconv.FormatInt(dls[2].ID+100, 10)
		out = ok(t, env.Schema, "held", "replay", first, unknown, first)
		require.Contains(t, out, "re-enqueued 1 relay dead letter")
		require.Contains(t, out, "1 of the 2 ids given were not waiting")
		require.Equal(t, 1, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+table+` WHERE payload->>'uuid' = $1`, events[0].ID),
			"the event is back in its shard with the same id")

		r := cli(t, append(dbArgs(env.Schema), "held", "replay", "-all")...)
		require.Equal(t, exitUsage, r.code)
		require.Contains(t, r.stderr, "-all needs -kind, -group or -aggregate")
		third := strconv.FormatInt(dls[2].ID, 10)
		r = cli(t, append(dbArgs(env.Schema), "held", "discard", third)...)
		require.Equal(t, exitUsage, r.code)
		require.Contains(t, r.stderr, "-reason is required")
		out = ok(t, env.Schema, "held", "discard", "-reason", "superseded", third)
		require.Contains(t, out, "discarded 1 held event: "+third)

		out = ok(t, env.Schema, "held", "replay", "-kind", "relay_dead_letter", "--all")
		require.Contains(t, out, "re-enqueued 1 relay dead letter")
		require.Equal(t, 2, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+table))
		st, err := admin.ReadOutboxStatus(ctx, env.Pool, env.Schema)
		require.NoError(t, err)
		require.Zero(t, st.DeadLetters)
		require.EqualValues(t, 2, st.Backlog())
		require.True(t, strings.Contains(ok(t, env.Schema, "held", "list"), "no held events (open)"))
		discarded := okJSON[[]heldJSONTest](t, env.Schema, "held", "list", "-status", "discarded", "-json")
		require.Len(t, discarded, 1)
		require.Equal(t, "superseded", discarded[0].DiscardReason)
	})

	// `held replay` warns, naming the groups, when it re-enqueues a relay dead
	// letter whose version a consumer group already gave up on: there the
	// replay arrives late and is held, not applied in order.
	t.Run("replay warns when a group skipped the version", func(t *testing.T) {
		t.Parallel()
		env, ctx := setup(t, 1, 0).env, context.Background()
		events := publish(t, env, "orders", "x", "y")
		deadLetterOutbox(t, env)
		st, err := store.New(env.Schema)
		require.NoError(t, err)
		for _, g := range []string{"billing", "shipping"} {
			require.NoError(t, st.RecordSkipped(ctx, env.Pool, store.Key{Group: g, AggregateType: "order", AggregateID: "x"}, 1, 1, "park timeout"))
		}
		dls := okJSON[[]heldJSONTest](t, env.Schema, "held", "list", "-json")
		require.Len(t, dls, 2)
		require.EqualValues(t, 1, dls[0].AggregateVersion)

		r := cli(t, append(dbArgs(env.Schema), "held", "replay", "-kind", "relay_dead_letter", "-all")...)
		require.Equal(t, exitOK, r.code)
		require.Contains(t, r.stderr, "warning: held event "+strconv.FormatInt(dls[0].ID, 10)+" (event "+events[0].ID+", order/x v1): consumer group(s) billing, shipping already gave up on that version")
		require.Contains(t, r.stderr, "eventline held list -kind late -group billing")
		require.NotContains(t, r.stderr, "order/y", "no group skipped y's version")
		require.Contains(t, r.stdout, "re-enqueued 2 relay dead letters", "a warning, not a refusal")
	})

	// Consumer dead letters through `held`: listed (binary payload and headers
	// exactly), replayed per group (asked of the running consumer), discarded
	// with a reason.
	t.Run("consumer dead letters: list, replay, discard", func(t *testing.T) {
		t.Parallel()
		env, ctx := setup(t, 1, 0).env, context.Background()
		holds := held.New(env.Schema)
		add := func(group, agg string, v int64, kind string, payload []byte, md map[string]string) int64 {
			e := consumertest.Event(agg, v)
			id, err := holds.AddDeadLetter(ctx, env.Pool, held.Event{Group: group, Topic: "orders", Handler: "h", FromKafka: true, Offset: v,
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
	})

	// A late event (its version was skipped after the park timeout) is listed
	// by `held list`, applied by the running consumer's sweeper after `held
	// replay` with the handler told it is late, or dropped by `held discard`.
	t.Run("late events: replay and discard", func(t *testing.T) {
		t.Parallel()
		env, ctx := setup(t, 1, 0).env, context.Background()
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
	})
}

// deadLetterOutbox moves every row of env's outbox shard 0 into
// held_events as the relay dead-letters them, and returns the shard's
// table.
func deadLetterOutbox(t *testing.T, env pgtest.Env) string {
	t.Helper()
	table := sqlident.Qualify(env.Schema, outbox.Table(0))
	_, err := env.Pool.Exec(context.Background(), `WITH moved AS (DELETE FROM `+table+` RETURNING "offset", uuid, payload, metadata)
		INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+`
			(kind, cause, reason, shard, message_uuid, event_id, aggregate_type, aggregate_id, aggregate_version, topic, payload,
			 header_keys, header_values, attempts, last_error)
		SELECT 'relay_dead_letter', 'retries_exhausted', 'gave up after 5 attempts', 0, convert_to(uuid::text, 'UTF8'), payload->>'uuid',
			payload->'metadata'->>'aggregate_type', payload->'metadata'->>'aggregate_id', (payload->'metadata'->>'aggregate_version')::bigint,
			payload->>'destination_topic', convert_to(payload::text, 'UTF8'), '{}', '{}', 5, 'kafka said no'
		FROM moved ORDER BY "offset"`)
	require.NoError(t, err)
	return table
}
