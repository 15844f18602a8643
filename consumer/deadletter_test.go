package consumer_test

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/versioning"
)

// createBigTopic creates a topic whose records may be up to 16 MiB.
func createBigTopic(t *testing.T, brokers []string, topic string) {
	t.Helper()
	admin := clusterAdmin(t, brokers)
	defer admin.Close()
	limit := strconv.Itoa(16 << 20)
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"max.message.bytes": &limit}}, false))
}

// publishBig publishes with a producer that accepts records up to 16 MiB.
func publishBig(t *testing.T, brokers []string, topic string, msgs ...*message.Message) {
	t.Helper()
	sc := kafkaconf.Producer("test-big")
	sc.Producer.MaxMessageBytes = 16 << 20
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}, OverwriteSaramaConfig: sc}, watermill.NopLogger{})
	require.NoError(t, err)
	defer pub.Close()
	for _, m := range msgs {
		require.NoError(t, pub.Publish(topic, m))
	}
}

// Issue 8, item 2: records whose dead-letter copy is larger than the
// dead-letter producer accepts (a 1 MiB event id, a 5 MiB payload, an
// unknown-type record of 1,048,476 bytes) used to be nacked and
// redelivered forever, stalling their partition. Now they are kept whole
// in held_events (there is no Kafka copy to refuse them), and the records
// behind them are applied.
func TestOversizeDeadLettersNeverStallThePartition(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	topic := kafkatest.Topic(t, "big")
	createBigTopic(t, k.brokers, topic)
	const group = "oversize"
	cfg := k.config(group)
	cfg.Topics = []string{topic}
	reg := withMetrics(t, &cfg)
	c := k.newConsumer(t, cfg)
	require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		if len(e.Payload) > 4<<20 {
			return middleware.Permanent(errors.New("payload too large for this handler"))
		}
		return k.Apply(ctx, tx, group, e)
	}))

	a1, a2, b1 := consumertest.Event("a", 1), consumertest.Event("a", 2), consumertest.Event("b", 1)
	longID := consumertest.Message(t, consumertest.Event("x", 1))
	longID.Metadata.Set(eventline.MetaEventID, strings.Repeat("i", 1<<20))
	longID.Metadata.Set("x-binary", "nul\x00 \xff invalid")
	huge := consumertest.Event("y", 1)
	huge.Payload = append(append([]byte(`{"blob":"`), bytes.Repeat([]byte("z"), 5<<20)...), `"}`...)
	hugeMsg := consumertest.Message(t, huge)
	unknown := consumertest.Event("u", 1)
	unknown.Type = "thing.unheard_of"
	unknown.Payload = append(append([]byte(`"`), bytes.Repeat([]byte("u"), 1_048_476-600)...), `"`...)
	msgs := []*message.Message{consumertest.Message(t, a1), longID, hugeMsg, consumertest.Message(t, unknown),
		consumertest.Message(t, a2), consumertest.Message(t, b1)}
	publishBig(t, k.brokers, topic, msgs...)

	var dls []admin.HeldEvent
	r := start(t, c)
	// Lanes apply the records of other aggregates while the oversize ones
	// are dead-lettered: wait for both.
	eventually(t, 60*time.Second, func() bool {
		var err error
		dls, err = admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{Group: group})
		require.NoError(t, err)
		return len(k.Effects(t, group)) == 3 && len(dls) == 3
	}, "the oversize records are dead-lettered and the records behind them applied")
	require.NoError(t, r.stop())
	appliedOnce(t, k.Effects(t, group), []eventline.Event{a1, a2, b1})
	// Lanes and batches dead-letter concurrently: rows come in any order.
	slices.SortFunc(dls, func(a, b admin.HeldEvent) int { return cmp.Compare(a.Offset, b.Offset) })
	for i, want := range msgs[1:4] {
		d := dls[i]
		require.Equal(t, admin.HeldDeadLetter, d.Kind)
		require.Equal(t, dedup.KindPermanent, d.Cause)
		require.Equal(t, want.UUID, d.MessageUUID)
		require.True(t, bytes.Equal(want.Payload, d.Payload), "payload kept byte for byte")
		require.Equal(t, map[string]string(want.Metadata), d.Metadata, "headers kept byte for byte")
		require.Equal(t, topic, d.Topic)
		require.Equal(t, "eventline/"+group+"/"+topic, d.Handler, "the consumer names a topic's handler eventline/<group>/<topic>")
		require.True(t, d.FromKafka)
		require.EqualValues(t, i+1, d.Offset, "the record's offset")
	}
	require.Contains(t, dls[0].Reason, "event_id")
	require.Contains(t, dls[1].Reason, "too large")
	require.Contains(t, dls[2].Reason, "thing.unheard_of")
	require.Equal(t, 3.0, metrictest.Sum(t, reg, "eventline_consumer_events_dead_lettered_total"))
}

// Dead letters are replayed on request by a running consumer of the group,
// per aggregate in version order: once the cause is fixed the gap they
// left is filled and the versions parked behind it follow.
func TestDeadLettersAreReplayedInOrderByTheRunningConsumer(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "replay"
	var broken atomic.Bool
	broken.Store(true)
	handler := func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		if e.AggregateID == "x" && e.AggregateVersion == 2 && broken.Load() {
			return errors.New("the tax service rejects it")
		}
		return k.Apply(ctx, tx, group, e)
	}
	cfg := k.config(group)
	// Under Apply, a later version applied first would skip the earlier
	// one for good: only an in-order replay applies both.
	cfg.PolicyByType = map[string]versioning.GapPolicy{"thing.renamed": versioning.Apply}
	first := k.newConsumer(t, cfg)
	require.NoError(t, first.Handle("thing.changed", handler)) // thing.renamed is unknown to it

	renamed := func(agg string, v int64) eventline.Event {
		e := consumertest.Event(agg, v)
		e.Type = "thing.renamed"
		return e
	}
	x1, x2, x3 := consumertest.Event("x", 1), consumertest.Event("x", 2), consumertest.Event("x", 3)
	y1, y2, y3 := consumertest.Event("y", 1), renamed("y", 2), renamed("y", 3)
	publish(t, k.brokers, k.topic, messages(t, []eventline.Event{x1, x2, x3, y1, y2, y3})...)
	r := start(t, first)
	var dls []admin.HeldEvent
	eventually(t, 60*time.Second, func() bool {
		var err error
		dls, err = admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{Group: group})
		require.NoError(t, err)
		return len(dls) == 3 && len(k.Effects(t, group)) == 2
	}, "x2 (retries exhausted) and y2, y3 (unknown type) dead-lettered; x1, y1 applied")
	require.NoError(t, r.stop())
	// Different aggregates' lanes, and a batch's members rejected before
	// its transaction, dead-letter concurrently: rows come in any order
	// (replay orders them by aggregate and version).
	slices.SortFunc(dls, func(a, b admin.HeldEvent) int {
		return cmp.Or(cmp.Compare(a.AggregateID, b.AggregateID), cmp.Compare(a.AggregateVersion, b.AggregateVersion))
	})
	require.Equal(t, []string{x2.ID, y2.ID, y3.ID}, []string{dls[0].EventID, dls[1].EventID, dls[2].EventID})
	require.Equal(t, dedup.KindRetriesExhausted, dls[0].Cause)
	require.Equal(t, 1, k.Count(t, "parked_events", ""), "x3 waits for x2")

	// The fix is deployed: the tax service accepts x2, and a new version of
	// the consumer handles thing.renamed.
	broken.Store(false)
	second := k.newConsumer(t, cfg)
	require.NoError(t, second.Handle("thing.changed", handler))
	require.NoError(t, second.Handle("thing.renamed", handler))
	r = start(t, second)
	// Asked to replay y3 alone, the consumer refuses: y2 is still held.
	_, err := admin.ReplayHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{IDs: []int64{dls[2].ID}})
	require.NoError(t, err)
	eventually(t, 60*time.Second, func() bool {
		held, err := admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{IDs: []int64{dls[2].ID}})
		require.NoError(t, err)
		return len(held) == 1 && held[0].Status == admin.StatusHeld && held[0].Attempts == 1
	}, "y3 is held back behind y2")
	held, err := admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{IDs: []int64{dls[2].ID}})
	require.NoError(t, err)
	require.Contains(t, held[0].LastError, "of the same aggregate is still held")
	// `eventline held replay -group replay -all`.
	_, err = admin.ReplayHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{Group: group})
	require.NoError(t, err)
	eventually(t, 60*time.Second, func() bool { return len(k.Effects(t, group)) == 6 }, "the replays fill the gaps")
	require.NoError(t, r.stop())

	appliedOnce(t, k.Effects(t, group), []eventline.Event{x1, x2, x3, y1, y2, y3})
	dls, err = admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{Group: group, Statuses: []admin.HeldStatus{admin.StatusReplayed}})
	require.NoError(t, err)
	require.Len(t, dls, 3)
	require.Zero(t, k.Count(t, "parked_events", ""))
	require.Zero(t, k.Count(t, "skipped_versions", ""))
}

// Issue 8, item 13, through the runner: the consumer waits the documented
// schedule between attempts (before, Watermill's Retry waited about four
// times as long as configured, and its ShouldRetry saw different delays
// than it slept).
func TestConsumerRetriesOnTheDocumentedSchedule(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "schedule"
	cfg := k.config(group)
	cfg.MaxRetries = 4
	cfg.Retry.Initial = 100 * time.Millisecond
	cfg.Retry.Multiplier = 3
	cfg.Retry.Max = time.Second
	cfg.Retry.Jitter = middleware.NoJitter
	c := k.newConsumer(t, cfg)
	var waits []time.Duration
	waited := make(chan struct{}, 100)
	consumer.SetSleep(c, func(ctx context.Context, d time.Duration) error {
		waits = append(waits, d)
		waited <- struct{}{}
		return ctx.Err()
	})
	var attempts atomic.Int32
	require.NoError(t, c.Handle("thing.changed", func(context.Context, pgx.Tx, eventline.Event) error {
		attempts.Add(1)
		return errors.New("always fails")
	}))
	publish(t, k.brokers, k.topic, consumertest.Message(t, consumertest.Event("a", 1)))
	r := start(t, c)
	eventually(t, 60*time.Second, func() bool {
		n, err := admin.ListHeld(context.Background(), k.Pool, k.Schema, admin.HeldFilter{Kind: admin.HeldDeadLetter, Group: group})
		require.NoError(t, err)
		return len(n) == 1
	}, "dead-lettered after the last retry")
	require.NoError(t, r.stop())
	require.EqualValues(t, 5, attempts.Load(), "1 attempt + MaxRetries")
	require.Equal(t, []time.Duration{100 * time.Millisecond, 300 * time.Millisecond, 900 * time.Millisecond, time.Second}, waits)
}
