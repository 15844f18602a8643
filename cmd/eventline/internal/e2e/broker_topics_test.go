package e2e_test

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// publishPadded publishes, in one transaction, an event for each aggregate
// id given, with a payload of about size bytes.
func (r *faultRig) publishPadded(size int, aggregateIDs ...string) []eventline.Event {
	r.t.Helper()
	var evs []eventline.Event
	for _, id := range aggregateIDs {
		e, err := eventline.NewJSONEvent("order.updated", "order", id, map[string]string{"pad": strings.Repeat("x", size)})
		require.NoError(r.t, err)
		e.ID = eventline.NewEventID()
		evs = append(evs, e)
	}
	require.NoError(r.t, r.prod.Publish(context.Background(), r.env.Pool, evs...))
	return evs
}

// TestTopicLimitBelowTheRelaysDeadLettersOnlyTheTooLargeEvent: a topic
// whose max.message.bytes (16 KiB) is below the relay's
// RelayConfig.MaxMessageBytes (1 MiB, the default). A backlog of 400 events
// of about 1 KiB, among them one of 32 KiB (aggregate "big", version 2), is
// relayed: the large one is dead-lettered, with a reason that names both
// limits, and the shard moves on; every other event is delivered and
// applied once, in order (big's version 3 waits, parked, for version 2).
// Raised, the topic takes the replayed event and big's versions apply in
// order. Nothing else is dead-lettered, by the relay or the consumer.
func TestTopicLimitBelowTheRelaysDeadLettersOnlyTheTooLargeEvent(t *testing.T) {
	t.Parallel()
	const topicLimit = 16 << 10
	r := newFaultRigWith(t, 2, map[string]string{"max.message.bytes": strconv.Itoa(topicLimit)})
	ctx := context.Background()

	aggs := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	var published []eventline.Event
	for i := range 25 {
		published = append(published, r.publishPadded(1000, aggs...)...)
		if i == 12 {
			published = append(published, r.publishPadded(1000, "big")...)
			big := r.publishPadded(32<<10, "big")[0]
			published = append(published, big)
			published = append(published, r.publishPadded(1000, "big")...)
		}
	}
	r.runRelay()
	group := kafkatest.Topic(t, "limits") // unique: the broker may be shared
	cfg := r.consumerConfig(group, versioning.HoldLate, nil)
	cfg.ParkTimeout = 0 // nothing may be skipped
	r.runConsumer(cfg)

	require.Eventually(t, func() bool { return r.backlog() == 0 }, 2*time.Minute, 50*time.Millisecond, "the relay gets through the backlog")
	dls := r.relayDeadLetters()
	var deadIDs []string
	for _, d := range dls {
		deadIDs = append(deadIDs, d.EventID+" ("+d.AggregateID+" v"+strconv.FormatInt(d.AggregateVersion, 10)+"): "+d.Reason)
	}
	require.Len(t, dls, 1, "only the event larger than the topic's limit is dead-lettered:\n%s", strings.Join(deadIDs, "\n"))
	require.Equal(t, "big", dls[0].AggregateID)
	require.EqualValues(t, 2, dls[0].AggregateVersion)
	t.Logf("dead letter reason: %s", dls[0].Reason)
	for _, s := range []string{"max.message.bytes", strconv.Itoa(topicLimit), "RelayConfig.MaxMessageBytes", strconv.Itoa(producer.DefaultMaxMessageBytes)} {
		require.Contains(t, dls[0].Reason, s, "the reason names both limits")
	}

	recs, err := kafkatest.ReadTopic(ctx, r.brokers, r.topic)
	require.NoError(t, err)
	onKafka := map[string]int{}
	for _, rec := range recs {
		onKafka[rec.EventID]++
	}
	var missing []string
	for _, e := range published {
		if onKafka[e.ID] == 0 && e.ID != dls[0].EventID {
			missing = append(missing, e.AggregateID)
		}
	}
	require.Empty(t, missing, "events the relay took as delivered are not on Kafka (%d records there)", len(recs))
	want := len(published) - 2 // big v2 dead, big v3 parked
	r.waitRuns(group, want, "every event but big's v2 and v3")
	require.Equal(t, []int64{1}, versions(r.runs(group, "big")))
	require.Eventually(t, func() bool { return r.count(`SELECT count(*) FROM `+r.table("parked_events")) == 1 }, time.Minute, 20*time.Millisecond,
		"big's v3 is parked behind the dead-lettered v2")

	// The operator raises the topic's limit and replays the dead letter.
	require.NoError(t, r.cluster.SetTopicConfig(r.topic, "max.message.bytes", strconv.Itoa(producer.DefaultMaxMessageBytes+12)))
	res, err := admin.ReplayHeld(ctx, r.env.Pool, r.env.Schema, admin.HeldFilter{IDs: []int64{dls[0].ID}})
	require.NoError(t, err)
	require.Len(t, res.Enqueued, 1)
	r.waitRuns(group, len(published), "every event after the replay")
	require.Equal(t, []int64{1, 2, 3}, versions(r.runs(group, "big")))
	for _, a := range aggs {
		require.Equal(t, []int64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25}, versions(r.runs(group, a)), "aggregate %s", a)
	}
	require.Zero(t, r.count(`SELECT count(*) FROM `+r.table("held_events")+` WHERE kind = 'dead_letter'`), "consumer dead letters")
	require.Zero(t, r.count(`SELECT count(*) FROM `+r.table("parked_events")), "parked events")
	require.True(t, slices.ContainsFunc(r.runs(group, "big"), func(x run) bool { return x.Version == 2 && !x.Late }), "big v2 applied in order, not late")
}

// TestPartitionsAddedWhileRunningKeepPerAggregateOrder grows the topic from
// 3 to 8 partitions while events are published, relayed and consumed by
// two groups. The relay's partitioner (murmur2(key) mod the partition
// count) then puts most aggregates in another partition than before:
// an aggregate's later versions can be read before its earlier ones, still
// waiting in the old partition. The version gate parks them until their
// predecessors are applied: every event is applied once, in per-aggregate
// order, nothing lost (kafkaLoad.finish). The clients see the new
// partitions at their next metadata refresh (2 s here; Sarama's default is
// 10 minutes: see docs/OPERATIONS.md, "Adding partitions"). The consumers'
// database is cut off while the partitions are added, so that they lag
// behind the switch.
func TestPartitionsAddedWhileRunningKeepPerAggregateOrder(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a loaded pipeline for about 20 s")
	}
	t.Parallel()
	ctx := context.Background()
	k := kafkatest.Start(t, kafkatest.Config{})
	l := startKafkaLoad(t, k, "grown", loadTimeouts{consumer: kafkaNetTimeout, relay: kafkaRelayNetTimeout, refresh: 2 * time.Second})
	const grown = 8
	// The consumers' database is cut off meanwhile, so that they lag: the
	// old partitions still hold versions they have not read when later
	// versions of the same aggregates arrive in the new ones.
	l.proxy.Set(faultproxy.Refuse)
	l.proxy.Drop()
	addPartitions(ctx, t, l.brokers, l.topic, grown)
	added := time.Now()
	// Until the relay writes to the new partitions and both groups consume
	// them, and a while after.
	newRecords := func() int {
		recs, err := kafkatest.ReadTopic(ctx, l.brokers, l.topic)
		require.NoError(t, err)
		n := 0
		for _, r := range recs {
			if r.Partition >= 3 {
				n++
			}
		}
		return n
	}
	require.Eventually(t, func() bool { return newRecords() >= 100 }, 2*time.Minute, 200*time.Millisecond,
		"the relay writes to the new partitions")
	seen := time.Since(added)
	l.proxy.Set(faultproxy.Pass)
	l.caughtUp("after the partitions were added")
	l.finish()

	recs, err := kafkatest.ReadTopic(ctx, l.brokers, l.topic)
	require.NoError(t, err)
	partitions := map[string]map[int32]bool{}
	for _, r := range recs {
		if partitions[r.Key] == nil {
			partitions[r.Key] = map[int32]bool{}
		}
		partitions[r.Key][r.Partition] = true
	}
	moved := 0
	for _, ps := range partitions {
		if len(ps) > 1 {
			moved++
		}
	}
	var parked float64
	for _, g := range l.groups {
		parked += metrictest.Sum(t, g.reg, "eventline_consumer_events_parked_total")
	}
	t.Logf("3 → %d partitions: %d of %d aggregates moved partition; records in the new partitions %s after they were added; %g events parked (read before a predecessor) across both groups, all applied in order",
		grown, moved, len(partitions), seen.Round(100*time.Millisecond), parked)
	require.Positive(t, moved, "aggregates moved to other partitions")
}

// TestTopicDeletedAndRecreatedWhileTheRelayRuns deletes the topic under a
// running relay and consumer (after the consumer applied everything
// published so far: deleting a topic deletes the records on it), publishes
// while it is missing, recreates it and publishes again. The relay needs
// no restart: while the topic is missing its publishes fail, each naming
// the missing topic, and the events are dead-lettered after MaxAttempts (3
// here, 20 and 50 ms apart), never lost; once it exists again the relay
// publishes to it by itself. The consumer group starts the new topic from
// its oldest offset (the broker dropped the offsets committed on the
// deleted one) and, the dead letters replayed, applies every event once, in
// per-aggregate order.
func TestTopicDeletedAndRecreatedWhileTheRelayRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r := newFaultRig(t)
	r.runRelay()
	group := kafkatest.Topic(t, "recreated") // unique: the broker may be shared
	cfg := r.consumerConfig(group, versioning.HoldLate, nil)
	cfg.ParkTimeout = 0 // nothing may be skipped
	cfg.SaramaConfig.Metadata.RefreshFrequency = 2 * time.Second
	r.runConsumer(cfg)

	aggs := []string{"a", "b", "c", "d", "e", "f"}
	for _, a := range aggs {
		r.publish(a, 3)
	}
	r.waitRuns(group, 3*len(aggs), "before the topic is deleted")
	p := &pipeline{t: t, env: r.env, brokers: r.brokers, topic: r.topic}
	p.waitConsumed(group)

	deleteTopic(t, r.brokers, r.topic)
	deleted := time.Now()
	// The broker forgets the group's offsets on the deleted topic (so the
	// recreated one is read from its oldest offset, not from offsets that
	// would skip its first records).
	require.Eventually(t, func() bool { return slices.Equal(committedOffsets(t, r.brokers, group, r.topic), []int64{-1, -1, -1}) },
		30*time.Second, 50*time.Millisecond, "the group's offsets on the deleted topic are dropped")
	for _, a := range aggs {
		r.publish(a, 2) // v4, v5: the topic is missing
	}
	require.Eventually(t, func() bool { return len(r.relayDeadLetters()) > 0 }, time.Minute, 20*time.Millisecond, "the relay gives up on an event for the missing topic")
	require.NoError(t, r.cluster.CreateTopics(ctx, 3, r.topic))
	recreated := time.Since(deleted)
	for _, a := range aggs {
		r.publish(a, 4) // v6…v9: more records than the deleted topic held, so a stale offset would skip some
	}
	require.Eventually(t, func() bool { return r.backlog() == 0 }, 2*time.Minute, 50*time.Millisecond, "the relay gets through the outbox once the topic exists again")
	dls := r.relayDeadLetters()
	for _, d := range dls {
		require.Contains(t, d.Reason, "does not exist", "dead letter %s v%d", d.AggregateID, d.AggregateVersion)
		require.Contains(t, []int64{4, 5}, d.AggregateVersion, "only events published while the topic was missing")
	}
	res, err := admin.ReplayHeld(ctx, r.env.Pool, r.env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter})
	require.NoError(t, err)
	require.Len(t, res.Enqueued, len(dls))
	r.waitRuns(group, 9*len(aggs), "every event, the replayed ones included")
	for _, a := range aggs {
		require.Equal(t, []int64{1, 2, 3, 4, 5, 6, 7, 8, 9}, versions(r.runs(group, a)), "aggregate %s: each version applied once, in order", a)
	}
	for _, table := range []string{"parked_events", "skipped_versions"} {
		require.Zero(t, r.count(`SELECT count(*) FROM `+r.table(table)), "%s must be empty", table)
	}
	require.Zero(t, r.count(`SELECT count(*) FROM `+r.table("held_events")+` WHERE kind <> 'relay_dead_letter'`), "no consumer dead letter or late event held")
	t.Logf("topic missing for %s: %d of %d events published meanwhile dead-lettered by the relay, replayed; every event applied once, in order",
		recreated.Round(time.Millisecond), len(dls), 2*len(aggs))
}

// addPartitions raises topic's partition count to total and waits until
// every partition is served.
func addPartitions(ctx context.Context, t *testing.T, brokers []string, topic string, total int32) {
	t.Helper()
	admin, err := kafkatest.Admin(brokers)
	require.NoError(t, err)
	defer admin.Close()
	require.NoError(t, admin.CreatePartitions(topic, total, nil, false))
	require.NoError(t, kafkatest.WaitServed(ctx, brokers, int(total), topic))
}

// deleteTopic deletes topic and waits until the metadata no longer lists
// it.
func deleteTopic(t *testing.T, brokers []string, topic string) {
	t.Helper()
	admin, err := kafkatest.Admin(brokers)
	require.NoError(t, err)
	defer admin.Close()
	require.NoError(t, admin.DeleteTopic(topic))
	require.Eventually(t, func() bool {
		listed, err := admin.ListTopics()
		_, ok := listed[topic]
		return err == nil && !ok
	}, 30*time.Second, 20*time.Millisecond, "topic %s still listed after its deletion", topic)
}

// committedOffsets returns the offsets group has committed on topic's
// partitions 0-2, as the broker lists them (-1: none).
func committedOffsets(t *testing.T, brokers []string, group, topic string) []int64 {
	t.Helper()
	admin, err := kafkatest.Admin(brokers)
	require.NoError(t, err)
	defer admin.Close()
	res, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: {0, 1, 2}})
	require.NoError(t, err)
	var out []int64
	for p := int32(0); p < 3; p++ {
		off := int64(-1)
		if b := res.GetBlock(topic, p); b != nil {
			off = b.Offset
		}
		out = append(out, off)
	}
	return out
}
