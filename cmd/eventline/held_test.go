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
)

// deadLetterJSONTest mirrors the documented JSON of `dlq list -json`.
type deadLetterJSONTest struct {
	ID               int64      `json:"id"`
	Shard            int        `json:"shard"`
	EventID          string     `json:"event_id"`
	AggregateID      string     `json:"aggregate_id"`
	AggregateVersion int64      `json:"aggregate_version"`
	Topic            string     `json:"topic"`
	Attempts         int        `json:"attempts"`
	LastError        string     `json:"last_error"`
	Reason           string     `json:"reason"`
	DeadAt           time.Time  `json:"dead_at"`
	ReplayedAt       *time.Time `json:"replayed_at"`
}

// TestDLQListAndReplayThroughTheRelay dead-letters an event whose topic
// does not exist, lists it, creates the topic, replays it, and sees it
// arrive with its original id.
func TestDLQListAndReplayThroughTheRelay(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	_, brokers := kafkatest.Fake(t)
	topic, missing := kafkatest.Topic(t, "orders"), kafkatest.Topic(t, "missing")
	kafkatest.CreateTopic(t, brokers, topic, 2)
	good := publish(t, env, topic, "A")
	lost := publish(t, env, missing, "L")[0] // its topic does not exist yet (one aggregate, one topic: another aggregate)
	later := publish(t, env, topic, "A")

	relay := start(t, relayArgs(env, brokers, "-backoff-initial", "10ms", "-backoff-max", "20ms", "-max-attempts", "2")...)

	var dls []deadLetterJSONTest
	require.Eventually(t, func() bool {
		var out, errw syncBuffer
		if runWithEnv(context.Background(), append(dbArgs(env.Schema), "dlq", "list", "-json"), &out, &errw, noEnv) != 0 {
			return false
		}
		return jsonUnmarshal(out.String(), &dls) == nil && len(dls) == 1
	}, time.Minute, 50*time.Millisecond, "the event to a missing topic is dead-lettered")
	dl := dls[0]
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
	out := ok(t, env.Schema, "dlq", "list")
	require.Regexp(t, `ID\s+SHARD\s+EVENT ID\s+TYPE\s+AGGREGATE\s+VERSION\s+TOPIC\s+ATTEMPTS\s+DEAD AT\s+REASON`, out)
	require.Regexp(t, `(?m)^`+id+`\s+\d\s+`+lost.ID+`\s+order.updated\s+order/L\s+1\s+`+missing+`\s+2\s+`, out)
	st := okJSON[statusJSON](t, env.Schema, "status", "-json")
	require.EqualValues(t, 1, st.Outbox.DeadLetters)

	// Once the topic exists, replaying delivers the same event.
	kafkatest.CreateTopic(t, brokers, missing, 1)
	out = ok(t, env.Schema, "dlq", "replay", id)
	require.Contains(t, out, "replayed 1 dead letter: a running relay publishes them again")
	require.True(t, eventIDs(t, brokers, missing, 1)[lost.ID], "the replayed event reached Kafka with its id")

	r := cli(t, append(dbArgs(env.Schema), "dlq", "replay", id)...)
	require.Equal(t, exitFailure, r.code, "a dead letter is replayed once")
	require.Contains(t, r.stderr, "none of the ids ["+id+"] is a dead letter waiting for replay")
	out = ok(t, env.Schema, "dlq", "replay", "-all")
	require.Contains(t, out, "no dead letters waiting for replay")

	require.Empty(t, okJSON[[]deadLetterJSONTest](t, env.Schema, "dlq", "list", "-json"))
	all := okJSON[[]deadLetterJSONTest](t, env.Schema, "dlq", "list", "-all", "-json")
	require.Len(t, all, 1)
	require.NotNil(t, all[0].ReplayedAt)
	out = ok(t, env.Schema, "dlq", "list", "-all")
	require.Contains(t, out, "REPLAYED AT")
	require.Equal(t, exitOK, relay.stop(t))
}

// TestDLQReplayByIDAndAll works on dead letters written by hand with the
// envelope of real outbox rows, without a relay.
func TestDLQReplayByIDAndAll(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	ctx := context.Background()
	events := publish(t, env, "orders", "x", "y", "z")
	table := sqlident.Qualify(env.Schema, outbox.Table(0))
	// Move the outbox rows into dead_letters, as the relay would.
	_, err := env.Pool.Exec(ctx, `WITH moved AS (DELETE FROM `+table+` RETURNING "offset", uuid, payload, metadata)
		INSERT INTO `+sqlident.Qualify(env.Schema, "dead_letters")+`
			(shard, outbox_uuid, event_id, aggregate_type, aggregate_id, destination_topic, payload, metadata, attempts, last_error, dead_reason)
		SELECT 0, uuid, payload->>'uuid', payload->'metadata'->>'aggregate_type', payload->'metadata'->>'aggregate_id',
			payload->>'destination_topic', payload, metadata, 5, 'kafka said no', 'gave up after 5 attempts'
		FROM moved ORDER BY "offset"`)
	require.NoError(t, err)

	dls := okJSON[[]deadLetterJSONTest](t, env.Schema, "dlq", "list", "-json", "-limit", "2")
	require.Len(t, dls, 2, "-limit caps the list")
	out := ok(t, env.Schema, "dlq", "list", "-limit", "2")
	require.Contains(t, out, "(first 2 shown; raise -limit for more)")
	dls = okJSON[[]deadLetterJSONTest](t, env.Schema, "dlq", "list", "-json")
	require.Len(t, dls, 3)
	for i, d := range dls {
		require.Equal(t, events[i].ID, d.EventID, "oldest first")
		require.Equal(t, events[i].AggregateID, d.AggregateID)
		require.Equal(t, "orders", d.Topic)
	}

	first, unknown := strconv.FormatInt(dls[0].ID, 10), strconv.FormatInt(dls[2].ID+100, 10)
	out = ok(t, env.Schema, "dlq", "replay", first, unknown, first)
	require.Contains(t, out, "replayed 1 dead letter")
	require.Contains(t, out, "1 of the 2 ids given were not waiting for replay")
	require.Equal(t, 1, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+table+` WHERE payload->>'uuid' = $1`, events[0].ID),
		"the event is back in its shard with the same id")

	out = ok(t, env.Schema, "dlq", "replay", "--all")
	require.Contains(t, out, "replayed 2 dead letters")
	require.Equal(t, 3, pgtest.Count(t, env.Pool, `SELECT count(*) FROM `+table))
	st, err := admin.ReadOutboxStatus(ctx, env.Pool, env.Schema)
	require.NoError(t, err)
	require.Zero(t, st.DeadLetters)
	require.EqualValues(t, 3, st.Backlog())
	require.True(t, strings.Contains(ok(t, env.Schema, "dlq", "list"), "no dead letters waiting"))
}
