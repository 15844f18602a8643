package main

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
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

// TestHeldRelayDeadLetterThroughTheRelay dead-letters an event whose
// topic does not exist, lists it, creates the topic, replays it, and sees
// it arrive with its original id.
func TestHeldRelayDeadLetterThroughTheRelay(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	brokers := kafkatest.Brokers(t)
	topic, missing := kafkatest.Topic(t, "orders"), kafkatest.Topic(t, "missing")
	kafkatest.CreateTopic(t, brokers, topic, 2)
	good := publish(t, env, topic, "A")
	lost := publish(t, env, missing, "L")[0] // its topic does not exist yet (one aggregate, one topic: another aggregate)
	later := publish(t, env, topic, "A")

	relay := start(t, relayArgs(env, brokers, "-backoff-initial", "10ms", "-backoff-max", "20ms", "-max-attempts", "2")...)

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
}

// TestHeldReplayAndDiscardByIDAndAll works on relay dead letters written
// by hand with the envelope of real outbox rows, without a relay.
func TestHeldReplayAndDiscardByIDAndAll(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	events := publish(t, env, "orders", "x", "y", "z")
	table := sqlident.Qualify(env.Schema, outbox.Table(0))
	// Move the outbox rows into held_events, as the relay would.
	_, err := env.Pool.Exec(ctx, `WITH moved AS (DELETE FROM `+table+` RETURNING "offset", uuid, payload, metadata)
		INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+`
			(kind, cause, reason, shard, message_uuid, event_id, aggregate_type, aggregate_id, topic, payload, header_keys, header_values,
			 attempts, last_error)
		SELECT 'relay_dead_letter', 'retries_exhausted', 'gave up after 5 attempts', 0, convert_to(uuid::text, 'UTF8'), payload->>'uuid',
			payload->'metadata'->>'aggregate_type', payload->'metadata'->>'aggregate_id', payload->>'destination_topic',
			convert_to(payload::text, 'UTF8'), '{}', '{}', 5, 'kafka said no'
		FROM moved ORDER BY "offset"`)
	require.NoError(t, err)

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
}

// `held replay` warns, naming the groups, when it re-enqueues a relay
// dead letter whose version a consumer group already gave up on: there the
// replay arrives late and is held, not applied in order.
func TestHeldReplayWarnsWhenAGroupSkippedTheVersion(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	events := publish(t, env, "orders", "x", "y")
	table := sqlident.Qualify(env.Schema, outbox.Table(0))
	_, err := env.Pool.Exec(ctx, `WITH moved AS (DELETE FROM `+table+` RETURNING "offset", uuid, payload, metadata)
		INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+`
			(kind, cause, reason, shard, message_uuid, event_id, aggregate_type, aggregate_id, aggregate_version, topic, payload,
			 header_keys, header_values, attempts, last_error)
		SELECT 'relay_dead_letter', 'retries_exhausted', 'gave up after 5 attempts', 0, convert_to(uuid::text, 'UTF8'), payload->>'uuid',
			payload->'metadata'->>'aggregate_type', payload->'metadata'->>'aggregate_id', (payload->'metadata'->>'aggregate_version')::bigint,
			payload->>'destination_topic', convert_to(payload::text, 'UTF8'), '{}', '{}', 5, 'kafka said no'
		FROM moved ORDER BY "offset"`)
	require.NoError(t, err)
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
}
