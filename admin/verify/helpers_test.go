package verify_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/admin"
	"github.com/eventline/eventline/admin/verify"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/producer"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(settleSarama(m),
		// Sarama's metrics registry starts this once per process.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// fixture is one test's outbox (and consumer tables, unless consumer is
// set apart), topic and, optionally, Kafka.
type fixture struct {
	t     *testing.T
	ctx   context.Context
	env   pgtest.Env
	prod  *producer.Producer
	topic string
	// consumer holds the consumer tables; it is env unless the test gives
	// the consumer its own schema and pool.
	consumer pgtest.Env
	brokers  []string
}

func newFixture(t *testing.T, shards int) *fixture {
	t.Helper()
	env := pgtest.New(t, pgtest.Options{Shards: shards})
	f := &fixture{t: t, ctx: context.Background(), env: env, consumer: env, topic: "orders"}
	var err error
	f.prod, err = producer.New(f.ctx, env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: f.topic})
	require.NoError(t, err)
	return f
}

// withKafka gives the fixture a kfake cluster (or KAFKA_BROKERS) and a
// unique topic with the given partitions.
func (f *fixture) withKafka(partitions int32) {
	f.t.Helper()
	f.brokers = kafkatest.Brokers(f.t)
	f.topic = kafkatest.Topic(f.t, "orders")
	kafkatest.CreateTopic(f.t, f.brokers, f.topic, partitions)
	var err error
	f.prod, err = producer.New(f.ctx, f.env.Pool, producer.Config{Schema: f.env.Schema, DefaultTopic: f.topic})
	require.NoError(f.t, err)
}

// publish writes n events of aggregate order/id in one transaction and
// returns them with their versions.
func (f *fixture) publish(id string, n int) []eventline.Event {
	f.t.Helper()
	var in []eventline.Event
	for i := range n {
		e, err := eventline.NewJSONEvent("order.updated", "order", id, map[string]int{"n": i})
		require.NoError(f.t, err)
		in = append(in, e)
	}
	var out []eventline.Event
	err := pgx.BeginFunc(f.ctx, f.env.Pool, func(tx pgx.Tx) error {
		var err error
		out, err = f.prod.PublishTxReturning(f.ctx, tx, in...)
		return err
	})
	require.NoError(f.t, err)
	return out
}

// markRelayed moves every shard's relay position past its last row, as a
// relay that forwarded everything would.
func (f *fixture) markRelayed() {
	f.t.Helper()
	for s := 0; s < f.env.Shards; s++ {
		_, err := f.env.Pool.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(f.env.Schema, outbox.OffsetsTable(s))+`
			(consumer_group, offset_acked, last_processed_transaction_id)
			SELECT $1, "offset", transaction_id FROM `+sqlident.Qualify(f.env.Schema, outbox.Table(s))+`
			ORDER BY transaction_id DESC, "offset" DESC LIMIT 1
			ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = excluded.offset_acked,
				last_processed_transaction_id = excluded.last_processed_transaction_id`, outbox.RelayConsumerGroup)
		require.NoError(f.t, err)
	}
}

// shardTable is the outbox table holding an event.
func (f *fixture) shardTable(e eventline.Event) string {
	return sqlident.Qualify(f.env.Schema, outbox.Table(outbox.ShardFor(e.AggregateType, e.AggregateID, f.env.Shards)))
}

// age moves an event's outbox row back in time.
func (f *fixture) age(e eventline.Event, d time.Duration) {
	f.t.Helper()
	tag, err := f.env.Pool.Exec(f.ctx, `UPDATE `+f.shardTable(e)+` SET created_at = created_at - make_interval(secs => $2)
		WHERE payload->>'uuid' = $1`, e.ID, d.Seconds())
	require.NoError(f.t, err)
	require.EqualValues(f.t, 1, tag.RowsAffected())
}

// deadLetter records that the relay dead-lettered an event's outbox row.
func (f *fixture) deadLetter(e eventline.Event) {
	f.t.Helper()
	_, err := f.env.Pool.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(f.env.Schema, "held_events")+`
		(kind, shard, message_uuid, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, topic, attempts, last_error, cause, reason,
		 payload, header_keys, header_values)
		SELECT 'relay_dead_letter', $1, convert_to(uuid::text, 'UTF8'), $2, $3, $4, $5, $6, $7, 5, 'kafka: message too large', 'retries_exhausted',
			'gave up after 5 attempts', convert_to(payload::text, 'UTF8'), '{}', '{}'
		FROM `+f.shardTable(e)+` WHERE payload->>'uuid' = $2`,
		outbox.ShardFor(e.AggregateType, e.AggregateID, f.env.Shards), e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, f.topic)
	require.NoError(f.t, err)
}

// record writes a group's dedup record of e, processed ago before now, in
// a transaction of its own; an applied record also advances the version
// and adds a row to the group's effects table when there is one.
func (f *fixture) record(group string, e eventline.Event, outcome string, ago time.Duration) {
	f.t.Helper()
	c := f.consumer
	err := pgx.BeginFunc(f.ctx, c.Pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(c.Schema, "processed_events")+`
			(consumer_group, event_id, event_type, aggregate_type, aggregate_id, aggregate_version, outcome, processed_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, now() - make_interval(secs => $8))`,
			group, e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, outcome, ago.Seconds())
		if err != nil || outcome != "applied" {
			return err
		}
		if _, err := tx.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(c.Schema, "effects")+` (event_id) VALUES ($1)`, e.ID); err != nil {
			return err
		}
		_, err = tx.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(c.Schema, "aggregate_versions")+`
			(consumer_group, aggregate_type, aggregate_id, version) VALUES ($1, $2, $3, $4)
			ON CONFLICT (consumer_group, aggregate_type, aggregate_id) DO UPDATE SET version = GREATEST(aggregate_versions.version, excluded.version)`,
			group, e.AggregateType, e.AggregateID, e.AggregateVersion)
		return err
	})
	require.NoError(f.t, err)
}

// setVersion sets a group's version of aggregate order/id without any
// dedup record (as after retention deleted them).
func (f *fixture) setVersion(group, id string, v int64) {
	f.t.Helper()
	_, err := f.consumer.Pool.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(f.consumer.Schema, "aggregate_versions")+`
		(consumer_group, aggregate_type, aggregate_id, version) VALUES ($1, 'order', $2, $3)`, group, id, v)
	require.NoError(f.t, err)
}

// effect adds a row to the group's effects table.
func (f *fixture) effect(e eventline.Event) {
	f.t.Helper()
	_, err := f.consumer.Pool.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(f.consumer.Schema, "effects")+` (event_id) VALUES ($1)`, e.ID)
	require.NoError(f.t, err)
}

// createEffects creates the consumer's own effects table, which record
// appends to.
func (f *fixture) createEffects() {
	f.t.Helper()
	_, err := f.consumer.Pool.Exec(f.ctx, `CREATE TABLE `+sqlident.Qualify(f.consumer.Schema, "effects")+
		` (seq bigserial PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(f.t, err)
}

// relayedWithEffects creates the effects table, publishes n events of
// aggregate id and marks every row relayed.
func (f *fixture) relayedWithEffects(id string, n int) []eventline.Event {
	f.t.Helper()
	f.createEffects()
	evs := f.publish(id, n)
	f.markRelayed()
	return evs
}

// effectsQuery is the effects query over createEffects' table.
func (f *fixture) effectsQuery() string {
	return `SELECT event_id, seq FROM ` + sqlident.Qualify(f.consumer.Schema, "effects")
}

// park writes a parked event (its dedup record and its parked_events row).
func (f *fixture) park(group string, e eventline.Event, ago time.Duration) {
	f.t.Helper()
	f.record(group, e, "parked", ago)
	_, err := f.consumer.Pool.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(f.consumer.Schema, "parked_events")+`
		(consumer_group, aggregate_type, aggregate_id, aggregate_version, previous_version, event_id, event_type, topic, payload, metadata, parked_at)
		VALUES ($1, $2, $3, $4::bigint, $4::bigint - 1, $5, $6, $7, $8, '{}', now() - make_interval(secs => $9))`,
		group, e.AggregateType, e.AggregateID, e.AggregateVersion, e.ID, e.Type, f.topic, e.Payload, ago.Seconds())
	require.NoError(f.t, err)
}

// skip records that a group gave up on versions from..to of an aggregate.
func (f *fixture) skip(group, id string, from, to int64) {
	f.t.Helper()
	_, err := f.consumer.Pool.Exec(f.ctx, `INSERT INTO `+sqlident.Qualify(f.consumer.Schema, "skipped_versions")+`
		(consumer_group, aggregate_type, aggregate_id, from_version, to_version, reason) VALUES ($1, 'order', $2, $3, $4, 'park timeout: test')`,
		group, id, from, to)
	require.NoError(f.t, err)
}

// produce writes events to Kafka as the relay does (watermill-kafka's
// marshaler, keyed by aggregate id) and returns the offset of each.
func (f *fixture) produce(topic string, events []eventline.Event, extra map[string]string) []int64 {
	f.t.Helper()
	cfg := kafkaconf.Producer("verify-test")
	cfg.Producer.Idempotent = false
	cfg.Net.MaxOpenRequests = 5
	p, err := sarama.NewSyncProducer(f.brokers, cfg)
	require.NoError(f.t, err)
	defer p.Close()
	m := kafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
		return msg.Metadata.Get(eventline.MetaAggregateID), nil
	})
	var offsets []int64
	for _, e := range events {
		msg, err := eventline.Encode(e)
		require.NoError(f.t, err)
		for k, v := range extra {
			msg.Metadata.Set(k, v)
		}
		pm, err := m.Marshal(topic, msg)
		require.NoError(f.t, err)
		_, off, err := p.SendMessage(pm)
		require.NoError(f.t, err)
		offsets = append(offsets, off)
	}
	return offsets
}

// kafka returns a Sarama client of the fixture's brokers, an admin client
// over it, and what closes both.
func (f *fixture) kafka() (sarama.Client, sarama.ClusterAdmin, func()) {
	f.t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	client, err := sarama.NewClient(f.brokers, cfg)
	require.NoError(f.t, err)
	admin, err := sarama.NewClusterAdminFromClient(client)
	require.NoError(f.t, err)
	return client, admin, func() { _ = admin.Close() } // closes the client too
}

// commitAll commits the group's Kafka offsets at the end of every
// partition of topic: the group has consumed everything there.
func (f *fixture) commitAll(group, topic string) {
	f.t.Helper()
	client, admin, closeKafka := f.kafka()
	defer closeKafka()
	parts, err := client.Partitions(topic)
	require.NoError(f.t, err)
	// A bare OffsetCommit, as a group without members commits (Sarama's
	// offset manager first fetches offsets, which kfake refuses for a
	// group it does not know yet).
	coord, err := client.Coordinator(group)
	require.NoError(f.t, err)
	req := &sarama.OffsetCommitRequest{Version: 2, ConsumerGroup: group, ConsumerGroupGeneration: -1, RetentionTime: -1}
	for _, p := range parts {
		high, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(f.t, err)
		req.AddBlock(topic, p, high, 0, "")
	}
	resp, err := coord.CommitOffset(req)
	require.NoError(f.t, err)
	for _, errs := range resp.Errors {
		for p, kerr := range errs {
			require.Equal(f.t, sarama.ErrNoError, kerr, "commit %s/%d", topic, p)
		}
	}
	// Wait until the commit is visible to a reader.
	require.Eventually(f.t, func() bool {
		resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: parts})
		if err != nil {
			return false
		}
		for _, p := range parts {
			b := resp.GetBlock(topic, p)
			if b == nil || b.Offset < 0 {
				return false
			}
		}
		return true
	}, 10*time.Second, 20*time.Millisecond)
}

// committedToEnd reports whether the group's committed offsets reached the
// end of every partition of topic.
func (f *fixture) committedToEnd(group, topic string) bool {
	f.t.Helper()
	client, admin, closeKafka := f.kafka()
	defer closeKafka()
	parts, err := client.Partitions(topic)
	require.NoError(f.t, err)
	resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: parts})
	if err != nil {
		return false
	}
	for _, p := range parts {
		high, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(f.t, err)
		if b := resp.GetBlock(topic, p); high > 0 && (b == nil || b.Offset < high) {
			return false
		}
	}
	return true
}

// run runs verify on the fixture.
func (f *fixture) run(cfg verify.Config) *verify.Report {
	f.t.Helper()
	cfg.Schema = f.env.Schema
	var consumerDB admin.Beginner
	if f.consumer.Schema != f.env.Schema {
		cfg.ConsumerSchema = f.consumer.Schema
		consumerDB = f.consumer.Pool
	}
	if cfg.Brokers == nil {
		cfg.Brokers = f.brokers
	}
	ctx, cancel := context.WithTimeout(f.ctx, 2*time.Minute)
	defer cancel()
	rep, err := verify.Run(ctx, f.env.Pool, consumerDB, cfg)
	require.NoError(f.t, err)
	text, err := json.MarshalIndent(rep, "", "  ")
	require.NoError(f.t, err)
	f.t.Logf("verify:\n%s", text)
	return rep
}

// findings returns the report's findings about aggregate order/id.
func findings(rep *verify.Report, id string) []verify.Finding {
	var out []verify.Finding
	for _, f := range rep.Findings {
		if f.AggregateID == id {
			out = append(out, f)
		}
	}
	return out
}

// one requires exactly one finding about aggregate order/id, of the given
// kind, severity and version, and returns it.
func one(t *testing.T, rep *verify.Report, id string, kind verify.Kind, sev verify.Severity, version int64) verify.Finding {
	t.Helper()
	fs := findings(rep, id)
	require.Len(t, fs, 1, "findings about order/%s: %+v", id, fs)
	require.Equal(t, kind, fs[0].Kind, "%+v", fs[0])
	require.Equal(t, sev, fs[0].Severity, "%+v", fs[0])
	require.Equal(t, version, fs[0].AggregateVersion, "%+v", fs[0])
	return fs[0]
}

// ofKind requires exactly one finding of kind about aggregate order/id and
// returns it.
func ofKind(t *testing.T, rep *verify.Report, id string, kind verify.Kind) verify.Finding {
	t.Helper()
	var out []verify.Finding
	for _, f := range findings(rep, id) {
		if f.Kind == kind {
			out = append(out, f)
		}
	}
	require.Len(t, out, 1, "%s findings about order/%s: %+v", kind, id, rep.Findings)
	return out[0]
}

// group returns the report of a group.
func group(t *testing.T, rep *verify.Report, name string) verify.GroupReport {
	t.Helper()
	for _, g := range rep.Groups {
		if g.Group == name {
			return g
		}
	}
	t.Fatalf("group %s not in the report: %+v", name, rep.Groups)
	return verify.GroupReport{}
}

// separateConsumer gives the consumer tables their own schema and pool, so
// verify reads them as a separate database.
func (f *fixture) separateConsumer() {
	f.t.Helper()
	f.consumer = pgtest.New(f.t, pgtest.Options{Shards: 1})
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(f.t, err)
	pool, err := pgxpool.NewWithConfig(f.ctx, cfg)
	require.NoError(f.t, err)
	f.t.Cleanup(pool.Close)
	f.consumer.Pool = pool
}
