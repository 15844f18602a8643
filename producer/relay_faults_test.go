package producer_test

import (
	"context"
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

// fastRetries makes retry tests quick: a few short waits, three attempts.
var fastRetries = producer.RelayConfig{Backoff: eventline.Backoff{Initial: 10 * time.Millisecond, Multiplier: 2, Max: 20 * time.Millisecond}, MaxAttempts: 3}

// insertRaw puts a row into an outbox shard by hand, bypassing PublishTx.
func insertRaw(t *testing.T, env pgtest.Env, shard int, payload, metadata string) {
	t.Helper()
	_, err := env.Pool.Exec(context.Background(), `INSERT INTO `+sqlident.Qualify(env.Schema, outbox.Table(shard))+
		` (uuid, payload, metadata, transaction_id) VALUES ($1, $2::json, $3::json, pg_current_xact_id())`,
		eventline.NewEventID(), payload, metadata)
	require.NoError(t, err)
}

func waitDeadLetters(t *testing.T, env pgtest.Env, n int) []admin.HeldEvent {
	t.Helper()
	var dls []admin.HeldEvent
	require.Eventually(t, func() bool {
		var err error
		dls, err = admin.ListHeld(context.Background(), env.Pool, env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter})
		require.NoError(t, err)
		return len(dls) >= n
	}, time.Minute, 50*time.Millisecond, "want %d dead letters", n)
	return dls
}

func TestRelayDeadLettersWhatCanNeverBePublished(t *testing.T) {
	t.Parallel()
	k := kafkatest.Start(t, kafkatest.Config{})
	brokers := k.Brokers
	topic, rejecting := kafkatest.Topic(t, "orders"), kafkatest.Topic(t, "rejecting")
	require.NoError(t, k.CreateTopics(context.Background(), 3, topic))
	// Kafka refuses every record of this topic as too large: its
	// max.message.bytes is below any record batch.
	require.NoError(t, k.CreateTopicsWithConfig(context.Background(), 1, map[string]string{"max.message.bytes": "16"}, rejecting))

	// One shard, so every row below queues behind the one before it.
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	// A producer whose limit is above the relay's (Sarama's 1 MiB): the
	// relay must still dead-letter what it cannot send.
	p, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, MaxMessageBytes: 4 << 20})
	require.NoError(t, err)
	first := relaytest.Event(t, "a", topic, map[string]int{"n": 1})
	oversized := relaytest.Event(t, "b", topic, strings.Repeat("x", 2<<20)) // over Sarama's 1 MB default
	refused := relaytest.Event(t, "c", rejecting, map[string]int{"n": 1})
	require.NoError(t, p.Publish(context.Background(), env.Pool, first, oversized, refused))
	// Rows written by hand that no relay can make sense of.
	insertRaw(t, env, 0, `{"not":"an envelope"}`, `{}`)
	insertRaw(t, env, 0, `{}`, `[1, 2]`)
	noID := `{"destination_topic":"` + topic + `","uuid":"u1","payload":"` + base64.StdEncoding.EncodeToString([]byte(`{}`)) +
		`","metadata":{"aggregate_type":"order","aggregate_id":"d","event_type":"order.updated"}}`
	insertRaw(t, env, 0, noID, `{}`)
	last := relaytest.Event(t, "a", topic, map[string]int{"n": 2})
	require.NoError(t, p.Publish(context.Background(), env.Pool, last))

	cfg := fastRetries
	cfg.Brokers = brokers
	// This test counts copies: a lease that lapses while a loaded machine
	// stalls the relay (RebalanceInterval 250ms in relaytest) is taken
	// again and its unacknowledged rows sent again, which at-least-once
	// allows. A lease that outlives such stalls keeps the count exact.
	cfg.RebalanceInterval = 2 * time.Second
	relaytest.Start(t, env, cfg)

	// The shard moves past every bad row: the last event still arrives.
	counts := relaytest.Distinct(readTopic(t, brokers, topic, 2, 30*time.Second))
	require.Equal(t, 1, counts[first.ID])
	require.Equal(t, 1, counts[last.ID])

	dls := waitDeadLetters(t, env, 5)
	require.Len(t, dls, 5)
	reasons := map[string]string{}
	for _, d := range dls {
		reasons[d.EventID] += d.Reason
		require.NotEmpty(t, d.Reason)
		require.NotEmpty(t, d.LastError)
	}
	require.Contains(t, reasons[oversized.ID], "larger than")
	require.Contains(t, reasons[refused.ID], "too large")
	require.Equal(t, 1, dls[0].Attempts, "a message Kafka rejects for good is not retried")
	require.Equal(t, []string{"rejected", "rejected", "malformed", "malformed", "rejected"},
		[]string{dls[0].Cause, dls[1].Cause, dls[2].Cause, dls[3].Cause, dls[4].Cause})
	require.Contains(t, dls[2].Reason+dls[3].Reason+dls[4].Reason, "malformed")
	require.Equal(t, `[1, 2]`, dls[3].Metadata["_eventline_outbox_raw_metadata"], "a metadata column the relay cannot read is kept whole")
	require.Contains(t, dls[4].Reason, "event_id")
	require.Equal(t, "d", dls[4].AggregateID, "dead letters keep what could be read of the envelope")

	st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
	require.NoError(t, err)
	require.Zero(t, st.Backlog())
	require.EqualValues(t, 5, st.DeadLetters)
}

func TestRelayRetriesThenDeadLettersThenReplays(t *testing.T) {
	t.Parallel()
	brokers := kafkatest.Brokers(t)
	topic, missing := kafkatest.Topic(t, "orders"), kafkatest.Topic(t, "missing")
	kafkatest.CreateTopic(t, brokers, topic, 3)

	// One shard: m2 queues between a1 and a3. (One aggregate, one topic:
	// the event for the missing topic is another aggregate's.)
	env := pgtest.New(t, pgtest.Options{Shards: 1})
	p, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema})
	require.NoError(t, err)
	a1 := relaytest.Event(t, "A", topic, 1)
	m2 := relaytest.Event(t, "M", missing, 2) // its topic does not exist yet
	a3 := relaytest.Event(t, "A", topic, 3)
	require.NoError(t, p.Publish(context.Background(), env.Pool, a1, m2, a3))

	cfg := fastRetries
	cfg.Brokers = brokers
	_, stop := relaytest.Start(t, env, cfg)

	dls := waitDeadLetters(t, env, 1)
	require.Equal(t, m2.ID, dls[0].EventID)
	require.Equal(t, 3, dls[0].Attempts)
	require.EqualValues(t, 1, dls[0].AggregateVersion)
	require.Equal(t, missing, dls[0].Topic)
	require.Contains(t, dls[0].Reason, "gave up after 3 attempts")
	require.Equal(t, "retries_exhausted", dls[0].Cause)
	counts := relaytest.Distinct(readTopic(t, brokers, topic, 2, 30*time.Second))
	require.Equal(t, 1, counts[a3.ID], "the shard moved on after the dead letter")

	// Once the topic exists, a replay delivers the same event id and
	// aggregate version.
	kafkatest.CreateTopic(t, brokers, missing, 1)
	res, err := admin.ReplayHeld(context.Background(), env.Pool, env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter})
	require.NoError(t, err)
	require.Len(t, res.Enqueued, 1)
	recs := readTopic(t, brokers, missing, 1, 30*time.Second)
	require.Len(t, recs, 1)
	require.Equal(t, m2.ID, recs[0].EventID)
	require.EqualValues(t, 1, recs[0].Version)
	stop()

	_, err = admin.ReplayHeld(context.Background(), env.Pool, env.Schema, admin.HeldFilter{Kind: admin.HeldRelayDeadLetter})
	require.ErrorIs(t, err, admin.ErrNoHeld, "a dead letter is replayed once")
	all, err := admin.ListHeld(context.Background(), env.Pool, env.Schema, admin.HeldFilter{Statuses: []admin.HeldStatus{admin.StatusReplayed}})
	require.NoError(t, err)
	require.NotNil(t, all[0].ReplayedAt)
}

// TestRelaySurvivesKafkaDown takes Kafka down for a minute (5s with
// -short), as a crash does (kfake closed; Apache Kafka's JVM killed with
// SIGKILL), while events keep being written, then brings it back with its
// data: everything is delivered and nothing is dead-lettered, though
// MaxAttempts is tiny.
func TestRelaySurvivesKafkaDown(t *testing.T) {
	t.Parallel()
	down := time.Minute
	if testing.Short() {
		down = 5 * time.Second
	}
	k := kafkatest.Start(t, kafkatest.Config{Own: true, Persist: true})
	brokers := k.Brokers
	topic := kafkatest.Topic(t, "orders")
	require.NoError(t, k.CreateTopics(context.Background(), 3, topic))

	env := pgtest.New(t, pgtest.Options{Shards: 2})
	cfg := producer.RelayConfig{Brokers: brokers, Backoff: eventline.Backoff{Initial: 100 * time.Millisecond, Multiplier: 5, Max: time.Second}, MaxAttempts: 2}
	relaytest.Start(t, env, cfg)

	before := relaytest.PublishOrders(t, env, topic, 8, 40, 5)
	require.Len(t, relaytest.Distinct(readTopic(t, brokers, topic, len(before), 30*time.Second)), len(before))

	require.NoError(t, k.Crash())
	during := relaytest.PublishOrders(t, env, topic, 8, 40, 5)
	time.Sleep(down)
	require.NoError(t, k.Restart(context.Background()))

	counts := relaytest.Distinct(readTopic(t, brokers, topic, len(before)+len(during), 2*time.Minute))
	for _, e := range append(before, during...) {
		require.GreaterOrEqual(t, counts[e.ID], 1, "event %s lost while Kafka was down", e.ID)
	}
	st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
	require.NoError(t, err)
	require.Zero(t, st.DeadLetters, "an outage must not dead-letter events")
	require.Eventually(t, func() bool {
		st, err = admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
		return err == nil && st.Backlog() == 0 && st.Retrying == 0
	}, 30*time.Second, 100*time.Millisecond)
}

// TestRelayWaitsOutBrokerErrors injects retriable produce errors for a few
// seconds: the shard holds its place, and nothing is lost or dead-lettered.
func TestRelayWaitsOutBrokerErrors(t *testing.T) {
	t.Parallel()
	if kafkatest.Real() {
		t.Skip("kfake only: Apache Kafka 4 cannot be made to refuse produces with a retriable error on one node " +
			"(min.insync.replicas above the replication factor is capped at it, TestApacheKafkaCapsMinInsyncAtTheReplicationFactor); " +
			"TestRelaySurvivesKafkaDown and TestKafkaOutageDoesNotStretchTheRetryWait cover an unavailable Apache Kafka")
	}
	cluster, brokers := kafkatest.Fake(t)
	topic := kafkatest.Topic(t, "orders")
	kafkatest.CreateTopic(t, brokers, topic, 3)
	env := pgtest.New(t, pgtest.Options{Shards: 2})

	fault := cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	events := relaytest.PublishOrders(t, env, topic, 4, 20, 5)
	cfg := producer.RelayConfig{Brokers: brokers, Backoff: eventline.Backoff{Initial: 100 * time.Millisecond, Max: 100 * time.Millisecond, Multiplier: 1}, MaxAttempts: 1}
	relaytest.Start(t, env, cfg)
	require.NoError(t, fault.Wait(context.Background(), 3))
	time.Sleep(2 * time.Second) // the fault's duration: the relay keeps failing with MaxAttempts 1 and must not dead-letter
	fault.Remove()

	counts := relaytest.Distinct(readTopic(t, brokers, topic, len(events), 30*time.Second))
	require.Len(t, counts, len(events))
	st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
	require.NoError(t, err)
	require.Zero(t, st.DeadLetters)
}

// TestKafkaOutageDoesNotStretchTheRetryWait: while Kafka is unreachable a
// shard's wait doubles from Backoff.Initial up to 5 s, however long the
// outage, so it resumes soon after Kafka does. Before, those failures
// walked Backoff like a failing message (up to 10 min by default): here,
// whose second wait is an hour, the shard stopped retrying after its
// second failure.
func TestKafkaOutageDoesNotStretchTheRetryWait(t *testing.T) {
	t.Parallel()
	k := kafkatest.WithFaults(t)
	topic := kafkatest.Topic(t, "orders")
	require.NoError(t, k.CreateTopics(context.Background(), 1, topic))
	env := pgtest.New(t, pgtest.Options{Shards: 1})

	reg := prometheus.NewRegistry()
	metrics, err := producer.NewRelayMetrics(reg)
	require.NoError(t, err)
	cfg := producer.RelayConfig{Brokers: k.Brokers, Backoff: eventline.Backoff{Initial: 20 * time.Millisecond, Multiplier: 180_000, Max: time.Hour}, MaxAttempts: 1, Metrics: metrics}
	relaytest.Start(t, env, cfg)
	first := relaytest.PublishOrders(t, env, topic, 1, 1, 1)
	require.Len(t, relaytest.Distinct(readTopic(t, k.Brokers, topic, 1, 30*time.Second)), len(first), "the relay publishes")

	// Kafka becomes unavailable: kfake refuses produces with a retriable
	// error; Apache Kafka, which cannot be made to on one node, is cut off
	// (connections refused and reset).
	var restore func()
	if k.Fake != nil {
		fault := k.Fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
		restore = fault.Remove
	} else {
		k.Proxy.Set(faultproxy.Refuse)
		k.Proxy.Drop()
		restore = func() { k.Proxy.Set(faultproxy.Pass) }
	}
	events := append(first, relaytest.PublishOrders(t, env, topic, 2, 2, 1)...)
	require.Eventually(t, func() bool { return metrictest.Sum(t, reg, "eventline_relay_retries_total") >= 4 }, 30*time.Second, 20*time.Millisecond,
		"the shard keeps retrying while Kafka is unavailable")
	restore()

	counts := relaytest.Distinct(readTopic(t, k.Brokers, topic, len(events), 30*time.Second))
	require.Len(t, counts, len(events))
	st, err := admin.ReadOutboxStatus(context.Background(), env.Pool, env.Schema)
	require.NoError(t, err)
	require.Zero(t, st.DeadLetters)
}
