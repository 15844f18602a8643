package main

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

func TestParked(t *testing.T) {
	t.Parallel()

	t.Run("list, release, skipped", func(t *testing.T) {
		t.Parallel()
		env := setup(t, 1, 0).env
		// billing applied a1 v1 and parked v3, v4 (v2 is missing); shipping
		// parked b v2 (v1 is missing).
		early := parkGap(t, env, "billing", "a1", 1, 3, 4)
		parkGap(t, env, "shipping", "b", 0, 2)

		out := ok(t, env.Schema, "parked", "list")
		require.Regexp(t, `GROUP\s+AGGREGATE\s+VERSION\s+CURRENT`, out)
		require.Regexp(t, `billing\s+thing/a1\s+3\s+1\s+`+early[0].ID, out)
		require.Regexp(t, `billing\s+thing/a1\s+4\s+1\s+`+early[1].ID, out)
		require.Regexp(t, `shipping\s+thing/b\s+2\s+0\s+`, out)
		require.Contains(t, out, "billing thing/a1: at version 1, waiting for version 2; to give up on them: eventline parked release -reason '...' billing thing/a1")
		require.Contains(t, out, "shipping thing/b: at version 0, waiting for version 1")

		type parked struct {
			Group          string            `json:"group"`
			AggregateID    string            `json:"aggregate_id"`
			Version        int64             `json:"version"`
			CurrentVersion int64             `json:"current_version"`
			EventID        string            `json:"event_id"`
			Handler        string            `json:"handler"`
			Metadata       map[string]string `json:"metadata"`
			Payload        map[string]any    `json:"payload"`
		}
		list := okJSON[[]parked](t, env.Schema, "parked", "list", "-group", "billing", "-json")
		require.Len(t, list, 2)
		require.Equal(t, early[0].ID, list[0].EventID)
		require.EqualValues(t, 3, list[0].Version)
		require.EqualValues(t, 1, list[0].CurrentVersion)
		require.Equal(t, "things", list[0].Handler)
		require.Equal(t, "a1", list[0].Metadata[eventline.MetaAggregateID])
		require.EqualValues(t, 3, list[0].Payload["v"])
		list = okJSON[[]parked](t, env.Schema, "parked", "list", "-aggregate", "thing/b", "-json")
		require.Len(t, list, 1)
		require.Equal(t, "shipping", list[0].Group)
		list = okJSON[[]parked](t, env.Schema, "parked", "list", "-limit", "1", "-json")
		require.Len(t, list, 1)

		// Releasing an aggregate without parked events changes nothing.
		r := cli(t, append(dbArgs(env.Schema), "parked", "release", "-reason", "lost", "billing", "thing/zzz")...)
		require.Equal(t, exitFailure, r.code)
		require.Contains(t, r.stderr, "no parked events for thing/zzz")

		// Flags may follow the arguments.
		out = ok(t, env.Schema, "parked", "release", "billing", "thing/a1", "-reason", "v2 was dropped from the DLQ")
		require.Contains(t, out, "billing thing/a1: gave up on version 2 (recorded in skipped_versions)")
		require.Contains(t, out, "2 parked events now ready")

		st, err := store.New(env.Schema)
		require.NoError(t, err)
		cur, err := st.Current(context.Background(), env.Pool, store.Key{Group: "billing", AggregateType: "thing", AggregateID: "a1"})
		require.NoError(t, err)
		require.EqualValues(t, 2, cur, "the version moved to just below the lowest parked event")
		list = okJSON[[]parked](t, env.Schema, "parked", "list", "-group", "billing", "-json")
		require.Len(t, list, 2, "release applies nothing; the consumer's sweeper does")
		out = ok(t, env.Schema, "parked", "list", "-group", "billing")
		require.Contains(t, out, "billing thing/a1: at version 2, nothing missing")

		type rel struct {
			SkippedFrom int64 `json:"skipped_from"`
			SkippedTo   int64 `json:"skipped_to"`
			Ready       int   `json:"ready"`
		}
		got := okJSON[rel](t, env.Schema, "parked", "release", "-json", "-reason", "never published", "shipping", "thing/b")
		require.Equal(t, rel{SkippedFrom: 1, SkippedTo: 1, Ready: 1}, got)

		type skipped struct {
			Group       string `json:"group"`
			AggregateID string `json:"aggregate_id"`
			From        int64  `json:"from_version"`
			To          int64  `json:"to_version"`
			Reason      string `json:"reason"`
		}
		sk := okJSON[[]skipped](t, env.Schema, "parked", "skipped", "-json")
		require.Len(t, sk, 2)
		require.Equal(t, "billing", sk[0].Group)
		require.EqualValues(t, 2, sk[0].From)
		require.EqualValues(t, 2, sk[0].To)
		require.Contains(t, sk[0].Reason, "v2 was dropped from the DLQ")
		sk = okJSON[[]skipped](t, env.Schema, "parked", "skipped", "-group", "shipping", "-json")
		require.Len(t, sk, 1)
		require.Equal(t, "b", sk[0].AggregateID)
		out = ok(t, env.Schema, "parked", "skipped", "-aggregate", "thing/a1")
		require.Regexp(t, `billing\s+thing/a1\s+version 2\s+`, out)
		require.NotContains(t, out, "thing/b")
	})

	// For each parked aggregate, `parked list` says where the version it waits
	// for is: pending in the outbox, dead-lettered by the relay or by the
	// group, relayed to Kafka (in an outbox in another schema,
	// -outbox-schema), or nowhere. Before: only the missing version numbers.
	t.Run("list says where the missing version is", func(t *testing.T) {
		t.Parallel()
		env, ctx := setup(t, 2, 0).env, context.Background()
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
		other := setup(t, 1, 0).env
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
	})

	// With -brokers, a missing version the relay published is found on Kafka
	// (partition, offset) with the group's committed offset there: not reached
	// yet, then past it. Before: only "relayed", nothing about Kafka.
	t.Run("list finds the missing version on Kafka", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 1, 2)
		env, brokers, topic, ctx := b.env, b.brokers, b.topic, context.Background()

		// thing/k v1..v3 committed and relayed; the group applied v1 and
		// parked v3; v2 is on Kafka.
		p, err := producer.New(ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic})
		require.NoError(t, err)
		var events []eventline.Event
		for _, id := range []string{"k", "gone"} { // gone's events never reach Kafka
			for i := 0; i < 3; i++ {
				e, err := eventline.NewJSONEvent("thing.changed", "thing", id, map[string]int{"n": i})
				require.NoError(t, err)
				events = append(events, e)
			}
		}
		require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
			events, err = p.PublishTxReturning(ctx, tx, events...)
			return err
		}))
		_, err = env.Pool.Exec(ctx, `INSERT INTO `+sqlident.Qualify(env.Schema, outbox.OffsetsTable(0))+
			` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ($1, 1000000, pg_snapshot_xmax(pg_current_snapshot()))`, outbox.RelayConsumerGroup)
		require.NoError(t, err)
		parkGap(t, env, "billing", "k", 1, 3)
		parkGap(t, env, "billing", "gone", 1, 3)

		require.NoError(t, kafkatest.Publish(ctx, brokers, topic, events[:3]...))
		records, err := kafkatest.ReadTopic(ctx, brokers, topic)
		require.NoError(t, err)
		require.EqualValues(t, 2, events[1].AggregateVersion)
		i := slices.IndexFunc(records, func(r kafkatest.Record) bool { return r.EventID == events[1].ID })
		require.GreaterOrEqual(t, i, 0, "k v2 is on Kafka")
		part, offset := records[i].Partition, records[i].Offset

		type entry struct {
			WaitingFor struct {
				Location string `json:"location"`
				Detail   string `json:"detail"`
				Kafka    *struct {
					Topic          string `json:"topic"`
					Partition      int32  `json:"partition"`
					Offset         int64  `json:"offset"`
					GroupCommitted *int64 `json:"group_committed_offset"`
				} `json:"kafka"`
			} `json:"waiting_for"`
		}
		brokerArgs := []string{"-brokers", brokers[0]}
		list := okJSON[[]entry](t, env.Schema, append([]string{"parked", "list", "-json"}, brokerArgs...)...)
		require.Len(t, list, 2)
		gone := list[0].WaitingFor // listed by aggregate id
		require.Equal(t, "relayed", gone.Location)
		require.Contains(t, gone.Detail, "but not found there from its commit time on")
		w := list[1].WaitingFor
		require.Equal(t, "kafka", w.Location, w.Detail)
		require.NotNil(t, w.Kafka)
		require.Equal(t, []any{topic, part, offset}, []any{w.Kafka.Topic, w.Kafka.Partition, w.Kafka.Offset})
		require.Nil(t, w.Kafka.GroupCommitted)
		require.Contains(t, w.Detail, "the group has committed no offset there")

		commitEnd(t, brokers, "billing", topic, part)
		out := ok(t, env.Schema, append([]string{"parked", "list"}, brokerArgs...)...)
		require.Contains(t, out, "version 2: kafka: on Kafka at "+topic)
		require.Contains(t, out, "past it, yet it was not applied")
		require.Contains(t, ok(t, env.Schema, "parked", "list"), "version 2: relayed: relayed to Kafka topic", "without -brokers Kafka is not read")
	})
}

// parkGap runs aggregate "thing"/aggID through the version gate as a
// consumer of group would: versions 1..applied are applied, and each of
// park (all above applied+1) arrives early and is parked.
func parkGap(t testing.TB, env pgtest.Env, group, aggID string, applied int64, park ...int64) []eventline.Event {
	t.Helper()
	ctx := context.Background()
	st, err := store.New(env.Schema)
	require.NoError(t, err)
	for v := int64(1); v <= applied; v++ {
		require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
			a, err := st.Admit(ctx, tx, group, consumertest.Event(aggID, v), false)
			require.Equal(t, store.Next, a.Verdict)
			return err
		}))
	}
	var parked []eventline.Event
	for _, v := range park {
		e := consumertest.Event(aggID, v)
		require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
			a, err := st.Admit(ctx, tx, group, e, false)
			if err != nil {
				return err
			}
			require.Equal(t, store.Gap, a.Verdict)
			_, err = st.Park(ctx, tx, store.ParkRequest{Group: group, Event: e, Handler: "things", Topic: "things", MaxGap: versioning.DefaultMaxGap})
			return err
		}))
		parked = append(parked, e)
	}
	return parked
}

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

// commitEnd commits the group's offset at the end of one partition (a bare
// OffsetCommit, as a group without members commits) and waits until it is
// visible.
func commitEnd(t *testing.T, brokers []string, group, topic string, part int32) {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	client, err := sarama.NewClient(brokers, cfg)
	require.NoError(t, err)
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	require.NoError(t, err)
	high, err := client.GetOffset(topic, part, sarama.OffsetNewest)
	require.NoError(t, err)
	coord, err := client.Coordinator(group)
	require.NoError(t, err)
	req := &sarama.OffsetCommitRequest{Version: 2, ConsumerGroup: group, ConsumerGroupGeneration: -1, RetentionTime: -1}
	req.AddBlock(topic, part, high, 0, "")
	resp, err := coord.CommitOffset(req)
	require.NoError(t, err)
	for _, errs := range resp.Errors {
		for _, kerr := range errs {
			require.Equal(t, sarama.ErrNoError, kerr)
		}
	}
	require.Eventually(t, func() bool {
		resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: {part}})
		b := resp.GetBlock(topic, part)
		return err == nil && b != nil && b.Offset == high
	}, 10*time.Second, 20*time.Millisecond)
}
