package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// publishThings writes n versions of aggregate thing/id into env's outbox.
func publishThings(t testing.TB, env pgtest.Env, id string, n int) {
	t.Helper()
	p, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: "things"})
	require.NoError(t, err)
	for i := 0; i < n; i++ {
		e, err := eventline.NewJSONEvent("thing.changed", "thing", id, map[string]int{"n": i})
		require.NoError(t, err)
		require.NoError(t, p.Publish(context.Background(), env.Pool, e))
	}
}

// TestParkedListSaysWhereTheMissingVersionIs: for each parked aggregate,
// `parked list` says where the version it waits for is: pending in the
// outbox, dead-lettered by the relay or by the group, relayed to Kafka
// (in an outbox in another schema, -outbox-schema), or nowhere. Before:
// only the missing version numbers.
func TestParkedListSaysWhereTheMissingVersionIs(t *testing.T) {
	t.Parallel()
	env := pgtest.New(t, pgtest.Options{Shards: 2})
	ctx := context.Background()
	publishThings(t, env, "pending", 2)
	parkGap(t, env, "billing", "pending", 1, 3)
	parkGap(t, env, "billing", "relaydead", 1, 3)
	_, err := env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+`
		(kind, shard, message_uuid, payload, header_keys, header_values, aggregate_type, aggregate_id, aggregate_version, attempts, last_error, cause, reason)
		VALUES ('relay_dead_letter', 0, 'x', '', '{}', '{}', 'thing', 'relaydead', 2, 3, 'too large', 'rejected', 'rejected: too large')`)
	require.NoError(t, err)
	parkGap(t, env, "billing", "consumerdead", 1, 3)
	_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, "held_events")+`
		(kind, consumer_group, message_uuid, payload, header_keys, header_values, cause, reason, aggregate_type, aggregate_id, aggregate_version)
		VALUES ('dead_letter', 'billing', '\x01', '\x00', '{}', '{}', 'permanent', 'r', 'thing', 'consumerdead', 2)`)
	require.NoError(t, err)
	parkGap(t, env, "billing", "lost", 1, 3)

	out := ok(t, env.Schema, "parked", "list")
	require.Contains(t, out, "billing thing/pending: at version 1, waiting for version 2;")
	require.Regexp(t, `version 2: outbox_pending: in the outbox, not relayed yet \(committed \S+ ago, shard \d\)`, out)
	require.Regexp(t, `version 2: relay_dead_letter: the relay dead-lettered it \(held event \d+\): eventline held list -kind relay_dead_letter`, out)
	require.Regexp(t, `version 2: consumer_dead_letter: dead-lettered by the group \(permanent, held event \d+\): eventline held list -group billing`, out)
	require.Contains(t, out, "version 2: nowhere: not in the outbox")

	type entry struct {
		AggregateID string `json:"aggregate_id"`
		WaitingFor  *struct {
			Version  int64  `json:"version"`
			Location string `json:"location"`
		} `json:"waiting_for"`
	}
	list := okJSON[[]entry](t, env.Schema, "parked", "list", "-json")
	got := map[string]string{}
	for _, e := range list {
		require.NotNil(t, e.WaitingFor, e.AggregateID)
		require.EqualValues(t, 2, e.WaitingFor.Version)
		got[e.AggregateID] = e.WaitingFor.Location
	}
	require.Equal(t, map[string]string{"pending": "outbox_pending", "relaydead": "relay_dead_letter", "consumerdead": "consumer_dead_letter", "lost": "nowhere"}, got)

	// The outbox in another schema, where the relay has passed every row.
	other := pgtest.New(t, pgtest.Options{Shards: 1})
	publishThings(t, other, "lost", 2)
	_, err = other.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(other.Schema, outbox.OffsetsTable(0))+
		` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ($1, 1000000, pg_snapshot_xmax(pg_current_snapshot()))`, outbox.RelayConsumerGroup)
	require.NoError(t, err)
	out = ok(t, env.Schema, "parked", "list", "-aggregate", "thing/lost", "-outbox-schema", other.Schema)
	require.Regexp(t, `version 2: relayed: relayed to Kafka topic "things" \(committed \S+ ago, shard 0\)`, out)
	out = ok(t, env.Schema, "parked", "list", "-aggregate", "thing/lost", "-outbox-database-url", pgtest.URL(), "-outbox-schema", other.Schema)
	require.Contains(t, out, "version 2: relayed: relayed to Kafka topic")
	out = ok(t, env.Schema, "parked", "list", "-aggregate", "thing/lost", "-outbox-schema", "nosuchschema")
	require.Contains(t, out, "version 2: unknown: no outbox in schema nosuchschema")
	require.NotContains(t, ok(t, env.Schema, "parked", "list", "-locate=false"), "nowhere")
}
