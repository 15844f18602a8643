package e2e_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/relaytest"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
	"github.com/eventline/eventline/versioning"
)

// pipeline is one test's producer, relay and consumer over its own schema
// and topic.
type pipeline struct {
	t       *testing.T
	env     pgtest.Env
	brokers []string
	topic   string
	group   string // runConsumer's group
	prod    *producer.Producer
	applied string // qualified table of applied effects
}

func newPipeline(t *testing.T, shards int) *pipeline {
	t.Helper()
	env := pgtest.New(t, pgtest.Options{Shards: shards, MaxConns: 16})
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, "orders")
	kafkatest.CreateTopic(t, brokers, topic, 3)
	group := kafkatest.Topic(t, "e2e") // unique: the broker may be shared
	prod, err := producer.New(context.Background(), env.Pool, producer.Config{Schema: env.Schema, DefaultTopic: topic})
	require.NoError(t, err)
	applied := sqlident.Qualify(env.Schema, "applied")
	_, err = env.Pool.Exec(context.Background(), `CREATE TABLE `+applied+` (
		seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL)`)
	require.NoError(t, err)
	return &pipeline{t: t, env: env, brokers: brokers, topic: topic, group: group, prod: prod, applied: applied}
}

// runRelay runs a relay until the returned stop is called (or the test
// ends).
func (p *pipeline) runRelay(cfg producer.RelayConfig) (stop func() time.Duration) {
	p.t.Helper()
	cfg.Schema, cfg.Brokers = p.env.Schema, p.brokers
	cfg.PollInterval, cfg.RebalanceInterval = 200*time.Millisecond, 100*time.Millisecond
	r, err := producer.NewRelay(context.Background(), p.env.Pool, cfg)
	require.NoError(p.t, err)
	return relaytest.Background(p.t, r.Run)
}

// runConsumer runs a consumer whose handler records every applied event.
func (p *pipeline) runConsumer(policy versioning.GapPolicy) (stop func() time.Duration) {
	p.t.Helper()
	c, err := consumer.New(p.env.Pool, consumer.Config{
		Config: middleware.Config{
			Group:         p.group,
			Schema:        p.env.Schema,
			GapPolicy:     policy,
			SweepInterval: 100 * time.Millisecond,
		},
		Brokers: p.brokers,
		Topics:  []string{p.topic},
	})
	require.NoError(p.t, err)
	require.NoError(p.t, c.Handle("order.updated", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+p.applied+` (event_id, aggregate_id, version) VALUES ($1, $2, $3)`,
			e.ID, e.AggregateID, e.AggregateVersion)
		return err
	}))
	return relaytest.Background(p.t, c.Run)
}

func (p *pipeline) event(aggregateID string) eventline.Event {
	e, err := eventline.NewJSONEvent("order.updated", "order", aggregateID, map[string]string{"id": aggregateID})
	require.NoError(p.t, err)
	e.ID = eventline.NewEventID()
	return e
}

// appliedVersions returns the versions applied for an aggregate, in the
// order they were applied.
func (p *pipeline) appliedVersions(aggregateID string) []int64 {
	rows, err := p.env.Pool.Query(context.Background(), `SELECT version FROM `+p.applied+` WHERE aggregate_id = $1 ORDER BY seq`, aggregateID)
	require.NoError(p.t, err)
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(p.t, err)
	return vs
}

func (p *pipeline) waitApplied(n int) {
	p.t.Helper()
	require.Eventually(p.t, func() bool {
		return pgtest.Count(p.t, p.env.Pool, `SELECT count(*) FROM `+p.applied) >= n
	}, time.Minute, 20*time.Millisecond, "want %d applied effects", n)
}

// waitConsumed waits until the group has committed, on every partition of
// the topic, the offset after the last record: every record on Kafka,
// duplicates included, was handled, so nothing more will be applied. It
// returns how many records the topic holds.
func (p *pipeline) waitConsumed(group string) (records int64) {
	p.t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = kafkaconf.Version
	client, err := sarama.NewClient(p.brokers, cfg)
	require.NoError(p.t, err)
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	require.NoError(p.t, err)
	parts, err := client.Partitions(p.topic)
	require.NoError(p.t, err)
	var lag, total int64
	require.Eventually(p.t, func() bool {
		res, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{p.topic: parts})
		if err != nil {
			return false
		}
		lag, total = 0, 0
		for _, part := range parts {
			end, err := client.GetOffset(p.topic, part, sarama.OffsetNewest)
			require.NoError(p.t, err)
			committed := int64(0)
			if b := res.GetBlock(p.topic, part); b != nil && b.Offset > 0 {
				committed = b.Offset
			}
			lag += end - committed
			total += end
		}
		return lag == 0
	}, time.Minute, 20*time.Millisecond, "group %s commits every record of %s", group, p.topic)
	return total
}

// TestVersionGateRestoresOrderAfterXidInversion builds DESIGN.md's ordering
// caveat on purpose: transaction A takes its xid first and locks the
// aggregate last, so its version 2 precedes B's version 1 in the outbox and
// on Kafka. The consumer's version gate parks 2 and applies 1, then 2.
func TestVersionGateRestoresOrderAfterXidInversion(t *testing.T) {
	t.Parallel()
	p := newPipeline(t, 1)
	ctx := context.Background()

	txA, err := p.env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer txA.Rollback(ctx)
	_, err = txA.Exec(ctx, `SELECT pg_current_xact_id()`)
	require.NoError(t, err)
	require.NoError(t, p.prod.Publish(ctx, p.env.Pool, p.event("X"))) // B: version 1
	require.NoError(t, p.prod.PublishTx(ctx, txA, p.event("X")))      // A: version 2
	require.NoError(t, txA.Commit(ctx))

	p.runRelay(producer.RelayConfig{})
	p.runConsumer(versioning.Park)
	p.waitApplied(2)
	p.waitConsumed(p.group) // nothing more may arrive
	require.Equal(t, []int64{1, 2}, p.appliedVersions("X"))
}

// TestDuplicateFromRelayCrashIsAppliedOnce: the relay dies after Kafka
// accepted a batch and before the outbox recorded it, so Kafka holds every
// event of the batch twice; the consumer applies each once.
func TestDuplicateFromRelayCrashIsAppliedOnce(t *testing.T) {
	t.Parallel()
	p := newPipeline(t, 2)
	ctx := context.Background()
	var events []eventline.Event
	for i := 0; i < 20; i++ {
		events = append(events, p.event([]string{"A", "B", "C"}[i%3]))
	}
	require.NoError(t, p.prod.Publish(ctx, p.env.Pool, events...))

	// First relay: Kafka acknowledges, then "the process dies".
	crashed := make(chan struct{})
	var once sync.Once
	stop := p.runRelay(producer.RelayConfig{AfterPublish: func(int, []string) error {
		once.Do(func() { close(crashed) })
		return errors.New("simulated crash before the outbox ack")
	}})
	<-crashed
	stop()

	p.runRelay(producer.RelayConfig{})
	p.runConsumer(versioning.Park)
	p.waitApplied(len(events))
	records := p.waitConsumed(p.group) // every copy on Kafka handled: the duplicates too
	require.Greater(t, records, int64(len(events)), "Kafka holds duplicates of the crashed batch")
	require.Equal(t, len(events), pgtest.Count(t, p.env.Pool, `SELECT count(*) FROM `+p.applied), "each event applied once")
	require.Equal(t, len(events), pgtest.Count(t, p.env.Pool, `SELECT count(DISTINCT event_id) FROM `+p.applied))
	for _, agg := range []string{"A", "B", "C"} {
		vs := p.appliedVersions(agg)
		for i, v := range vs {
			require.EqualValues(t, i+1, v, "aggregate %s applied out of order: %v", agg, vs)
		}
	}
}

// TestSuppliedVersionGapsNeverPark: with gaps allowed, a producer publishes
// supplied versions that skip numbers, the first of them an aggregate's
// first event (version 5, following no version). Each event records the
// version it follows, so the consumer applies every one on arrival: none
// waits for the skipped versions.
func TestSuppliedVersionGapsNeverPark(t *testing.T) {
	t.Parallel()
	p := newPipeline(t, 2)
	prod, err := producer.New(context.Background(), p.env.Pool, producer.Config{Schema: p.env.Schema, DefaultTopic: p.topic, AllowVersionGaps: true})
	require.NoError(t, err)
	first, second, third := p.event("g"), p.event("g"), p.event("g")
	first.AggregateVersion, third.AggregateVersion = 5, 20
	var written []eventline.Event
	require.NoError(t, pgx.BeginFunc(context.Background(), p.env.Pool, func(tx pgx.Tx) error {
		var err error
		written, err = prod.PublishTxReturning(context.Background(), tx, first, second)
		return err
	}))
	require.Equal(t, eventline.NoPreviousVersion, written[0].PreviousVersion)
	require.NoError(t, prod.Publish(context.Background(), p.env.Pool, third))

	p.runRelay(producer.RelayConfig{})
	p.runConsumer(versioning.Park)
	p.waitApplied(3)
	require.Equal(t, []int64{5, 6, 20}, p.appliedVersions("g"))
	require.Zero(t, pgtest.Count(t, p.env.Pool, `SELECT count(*) FROM `+sqlident.Qualify(p.env.Schema, "parked_events")))
}
