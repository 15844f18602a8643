package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

// TestLanesRunAggregatesOfOnePartitionConcurrently holds the first event of
// aggregate a until an event of aggregate b, behind it on the same
// partition, has been applied. With one event per partition at a time
// (the runner before lanes) b never runs and a gives up.
func TestLanesRunAggregatesOfOnePartitionConcurrently(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "lanes"
	cfg := k.config(group)
	cfg.Lanes, cfg.BatchSize = 2, 1
	c := k.newConsumer(t, cfg)
	bApplied := make(chan struct{})
	var once sync.Once
	require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		if e.AggregateID == "a" {
			select {
			case <-bApplied:
			case <-time.After(20 * time.Second):
				return middleware.Permanent(errors.New("b was never applied while a was in flight"))
			}
		}
		if err := k.Apply(ctx, tx, group, e); err != nil {
			return err
		}
		if e.AggregateID == "b" {
			middleware.AfterCommit(ctx, func() { once.Do(func() { close(bApplied) }) })
		}
		return nil
	}))
	a, b := consumertest.Event("a", 1), consumertest.Event("b", 1)
	publish(t, k.brokers, k.topic, consumertest.Message(t, a), consumertest.Message(t, b))
	r := start(t, c)
	eventually(t, 40*time.Second, func() bool { return len(k.Effects(t, group)) == 2 }, "both applied")
	require.NoError(t, r.stop())
	effects := k.Effects(t, group)
	require.Equal(t, []string{b.ID, a.ID}, []string{effects[0].EventID, effects[1].EventID}, "b overtook a")
}

// TestCommittedOffsetIsLowestUnfinished blocks one event while later
// events of other aggregates on the same partition finish, and checks
// that the group's committed offset stays at the blocked event until it
// finishes, then moves past everything.
func TestCommittedOffsetIsLowestUnfinished(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "offsets"
	cfg := k.config(group)
	cfg.Lanes = 2
	c := k.newConsumer(t, cfg)
	release := make(chan struct{})
	require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		if e.AggregateID == "held" {
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return k.Apply(ctx, tx, group, e)
	}))
	first := consumertest.Event("warmup", 1) // offset 0
	held := consumertest.Event("held", 1)    // offset 1
	rest := []eventline.Event{consumertest.Event("free", 1), consumertest.Event("free", 2), consumertest.Event("free", 3)}
	publish(t, k.brokers, k.topic, consumertest.Message(t, first))
	r := start(t, c)
	// Offsets are committed at all: the warm-up event's is.
	eventually(t, 40*time.Second, func() bool { return committedOffset(t, k, group) == 1 }, "offset 1 committed after the first event")

	msgs := []*message.Message{consumertest.Message(t, held)}
	for _, e := range rest {
		msgs = append(msgs, consumertest.Message(t, e))
	}
	publish(t, k.brokers, k.topic, msgs...)
	eventually(t, 30*time.Second, func() bool { return len(k.Effects(t, group)) == 4 }, "the events behind the held one are applied")
	// Watch several auto-commit intervals (100ms): the held event's offset
	// is never passed.
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		require.EqualValues(t, 1, committedOffset(t, k, group), "the committed offset passed an unfinished event")
		time.Sleep(50 * time.Millisecond) // sampling interval of the observation window (several auto-commits)
	}
	close(release)
	eventually(t, 30*time.Second, func() bool { return committedOffset(t, k, group) == 5 }, "offset 5 committed once the held event finished")
	require.NoError(t, r.stop())
	appliedOnce(t, k.Effects(t, group), append([]eventline.Event{first, held}, rest...))
}

// committedOffset returns the group's committed offset of partition 0, or
// -1.
func committedOffset(t *testing.T, k kenv, group string) int64 {
	t.Helper()
	admin := clusterAdmin(t, k.brokers)
	defer admin.Close()
	res, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{k.topic: {0}})
	if errors.Is(err, sarama.ErrGroupIDNotFound) {
		return -1 // nothing committed yet
	}
	require.NoError(t, err)
	b := res.GetBlock(k.topic, 0)
	if b == nil {
		return -1
	}
	return b.Offset
}

// batchConfig is a one-lane configuration whose batches wait up to
// linger to fill, so events published before the consumer starts form
// full batches.
func batchConfig(k kenv, group string, size int) consumer.Config {
	cfg := k.config(group)
	cfg.Lanes, cfg.BatchSize, cfg.BatchLinger = 1, size, 500*time.Millisecond
	return cfg
}

func distinctEvents(n int) []eventline.Event {
	var evs []eventline.Event
	for i := 0; i < n; i++ {
		evs = append(evs, consumertest.Event(fmt.Sprintf("agg-%d", i), 1))
	}
	return evs
}

func messagesOf(t *testing.T, evs []eventline.Event) []*message.Message {
	var msgs []*message.Message
	for _, e := range evs {
		msgs = append(msgs, consumertest.Message(t, e))
	}
	return msgs
}

// TestBatchAppliesInOneTransaction checks that a lane's batch is applied
// in one PostgreSQL transaction: every effect carries the same xmin.
func TestBatchAppliesInOneTransaction(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "batch"
	c := k.newConsumer(t, batchConfig(k, group, 8))
	require.NoError(t, c.Handle("thing.changed", k.applyHandler(group)))
	evs := distinctEvents(8)
	publish(t, k.brokers, k.topic, messagesOf(t, evs)...)
	r := start(t, c)
	eventually(t, 40*time.Second, func() bool { return len(k.Effects(t, group)) == 8 }, "all applied")
	require.NoError(t, r.stop())
	appliedOnce(t, k.Effects(t, group), evs)
	txs := k.Transactions(t, group)
	for _, e := range evs {
		require.Equal(t, txs[evs[0].ID], txs[e.ID], "one transaction for the batch")
	}
	require.Equal(t, 8, k.Count(t, "processed_events", ""))
}

// TestFailureInBatchCostsOnlyItself puts a failing and a panicking event
// in the middle of batches: the events before each commit together, the
// failing one follows its own retries (exactly 1 + MaxRetries attempts)
// to its dead letter, the panicking one is applied on its retry,
// and the events after each commit together in a later batch: [0 1 2]
// together, 3 dead-lettered, [4] (before the panic), 5 on its retry, [6 7].
func TestFailureInBatchCostsOnlyItself(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "batchfail"
	c := k.newConsumer(t, batchConfig(k, group, 8))
	evs := distinctEvents(8)
	poison, flaky := evs[3], evs[5]
	var poisonAttempts, flakyAttempts atomic.Int32
	require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		if err := k.Apply(ctx, tx, group, e); err != nil {
			return err
		}
		switch e.ID {
		case poison.ID:
			poisonAttempts.Add(1)
			return errors.New("smtp down")
		case flaky.ID:
			if flakyAttempts.Add(1) == 1 {
				panic("flaky handler")
			}
		}
		return nil
	}))
	publish(t, k.brokers, k.topic, messagesOf(t, evs)...)
	r := start(t, c)
	dead := deadLetters(t, k, group, 1)
	eventually(t, 40*time.Second, func() bool { return len(k.Effects(t, group)) == 7 }, "every other event applied")
	require.NoError(t, r.stop())

	require.Equal(t, poison.ID, dead[0].MessageUUID)
	require.Equal(t, dedup.KindRetriesExhausted, dead[0].Cause)
	require.Contains(t, dead[0].Reason, "smtp down")
	require.EqualValues(t, 3, poisonAttempts.Load(), "the attempt in the batch counts: 1 attempt + MaxRetries (2)")
	require.EqualValues(t, 2, flakyAttempts.Load(), "the panic in the batch, then one retry")
	var applied []eventline.Event
	for _, e := range evs {
		if e.ID != poison.ID {
			applied = append(applied, e)
		}
	}
	appliedOnce(t, k.Effects(t, group), applied)
	require.Equal(t, 0, k.Count(t, "processed_events", `WHERE event_id = $1`, poison.ID))

	txs := k.Transactions(t, group)
	require.Equal(t, txs[evs[0].ID], txs[evs[1].ID], "the events before the failure committed together")
	require.Equal(t, txs[evs[0].ID], txs[evs[2].ID], "the events before the failure committed together")
	require.Equal(t, txs[evs[6].ID], txs[evs[7].ID], "the events after the panic committed together")
	require.NotEqual(t, txs[evs[0].ID], txs[evs[4].ID], "the failure split the batch")
	require.NotEqual(t, txs[evs[4].ID], txs[evs[6].ID], "the panic split the batch")
}

// TestReorderedEventsInOneBatchApplyAtOnce delivers an aggregate's version
// 2 before its version 1 (and version 3 after them) in one batch, with the
// sweeper effectively off: version 2 must be parked and drained by version
// 1 in the same pass, as one event at a time would, not left for the
// sweeper.
func TestReorderedEventsInOneBatchApplyAtOnce(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "reorder"
	cfg := batchConfig(k, group, 8)
	cfg.SweepInterval, cfg.ParkTimeout = time.Hour, time.Hour
	c := k.newConsumer(t, cfg)
	require.NoError(t, c.Handle("thing.changed", k.applyHandler(group)))
	x1, x2, x3, y1 := consumertest.Event("x", 1), consumertest.Event("x", 2), consumertest.Event("x", 3), consumertest.Event("y", 1)
	publish(t, k.brokers, k.topic, messagesOf(t, []eventline.Event{x2, x1, y1, x2, x3})...)
	r := start(t, c)
	eventually(t, 30*time.Second, func() bool { return len(k.Effects(t, group)) == 4 }, "every event applied without the sweeper")
	require.NoError(t, r.stop())
	appliedOnce(t, k.Effects(t, group), []eventline.Event{x1, x2, x3, y1})
	value, last := k.State(t, group, "thing", "x")
	require.EqualValues(t, 3, last)
	require.Equal(t, fold(1, 2, 3), value)
	require.Equal(t, 0, k.Count(t, "parked_events", ""))
}

// TestRebalanceMidBatchAbandonsIt holds a batch in the middle of its
// transaction when a second consumer joins the group. The partition is
// revoked; the first consumer waits half the rebalance timeout for the
// batch, then abandons it: the transaction rolls back, the offsets stay,
// and whoever gets the partition applies every event once, in order.
func TestRebalanceMidBatchAbandonsIt(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "midbatch"
	var stalled, abandoned atomic.Bool
	entered := make(chan struct{})
	newConsumer := func(stall bool) *consumer.Consumer {
		c := k.newConsumer(t, batchConfig(k, group, 8))
		require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
			if err := k.Apply(ctx, tx, group, e); err != nil {
				return err
			}
			if stall && e.AggregateVersion == 3 && stalled.CompareAndSwap(false, true) {
				close(entered)
				<-ctx.Done() // released only by the abandon
				abandoned.Store(true)
				return ctx.Err()
			}
			return nil
		}))
		return c
	}
	var evs []eventline.Event
	for v := int64(1); v <= 4; v++ {
		evs = append(evs, consumertest.Event("a", v), consumertest.Event("b", v))
	}
	publish(t, k.brokers, k.topic, messagesOf(t, evs)...)
	a := start(t, newConsumer(true))
	waitFor(t, entered, 60*time.Second, "the batch to reach its handler")
	b := start(t, newConsumer(false)) // joins: the partition is revoked mid-batch
	eventually(t, 60*time.Second, func() bool { return len(k.Effects(t, group)) == len(evs) }, "every event applied after the rebalance")
	require.True(t, abandoned.Load(), "the stalled batch was abandoned by the revocation")
	require.NoError(t, a.stop())
	require.NoError(t, b.stop())
	appliedOnce(t, k.Effects(t, group), evs)
	for _, id := range []string{"a", "b"} {
		value, last := k.State(t, group, "thing", id)
		require.EqualValues(t, 4, last)
		require.Equal(t, fold(1, 2, 3, 4), value)
	}
}

func TestRunnerConfigErrorsNameTheField(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 1)
	base := consumer.Config{Config: middleware.Config{Group: "g"}, Brokers: []string{"127.0.0.1:9092"}, Topics: []string{"t"}}
	for _, tc := range []struct {
		mut  func(*consumer.Config)
		want string
	}{
		{func(c *consumer.Config) { c.Group = "" }, "consumer.Config.Group"},
		{func(c *consumer.Config) { c.Brokers = []string{"nohost"} }, "consumer.Config.Brokers"},
		{func(c *consumer.Config) { c.Lanes = -2 }, "consumer.Config.Lanes"},
		{func(c *consumer.Config) { c.BatchSize = consumer.MaxBatchSize + 1 }, "consumer.Config.BatchSize"},
		{func(c *consumer.Config) { c.BatchLinger = -time.Second }, "consumer.Config.BatchLinger"},
		{func(c *consumer.Config) { c.ShutdownTimeout = -time.Second }, "consumer.Config.ShutdownTimeout"},
	} {
		cfg := base
		tc.mut(&cfg)
		_, err := consumer.New(pool, cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := consumer.New(pool, base)
	require.NoError(t, err)
}

// TestRebalanceMidBatchFinishesIt holds a batch in the middle of its
// transaction when a second consumer joins, and lets it go while the
// partition is being revoked: the batch commits, its offsets are committed
// before the partition moves, and whoever consumes next starts after it:
// no message of the batch is delivered again (counted in front of the
// eventline middleware, where duplicates still show).
func TestRebalanceMidBatchFinishesIt(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "finishbatch"
	var stalled atomic.Bool
	entered, release := make(chan struct{}), make(chan struct{})
	aLogger, aStopping := watchLog(partitionStopping)
	var delivered atomic.Int64
	count := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			delivered.Add(1)
			return h(msg)
		}
	}
	newConsumer := func(stall bool) *consumer.Consumer {
		cfg := batchConfig(k, group, 8)
		cfg.Middleware = []message.HandlerMiddleware{count}
		if stall {
			cfg.Logger = aLogger
		}
		c := k.newConsumer(t, cfg)
		require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
			if err := k.Apply(ctx, tx, group, e); err != nil {
				return err
			}
			if stall && stalled.CompareAndSwap(false, true) {
				close(entered)
				<-release
			}
			return nil
		}))
		return c
	}
	first := distinctEvents(8)
	publish(t, k.brokers, k.topic, messagesOf(t, first)...)
	a := start(t, newConsumer(true))
	waitFor(t, entered, 60*time.Second, "the batch to reach its handler")
	revoked := aStopping.Next()
	b := start(t, newConsumer(false)) // joins: the partition is revoked mid-batch
	// The group starts rebalancing when b joins; a learns it on its next
	// heartbeat (every 500ms) and stops its partition, giving the batch
	// half the rebalance timeout (2.5s). Release the batch in that window,
	// once a says its partition stops: released before, the batch would
	// commit as in any run and the test would prove nothing.
	eventually(t, 30*time.Second, func() bool { return groupState(t, k, group) == "PreparingRebalance" }, "the group rebalances")
	waitFor(t, revoked, 30*time.Second, "a's partition is revoked with the batch in flight")
	require.EqualValues(t, len(first), aStopping.MaxInt("events"), "the partition stopped with the whole batch in flight")
	close(release)
	eventually(t, 30*time.Second, func() bool { return len(k.Effects(t, group)) == len(first) }, "the held batch commits")
	// After the rebalance, a new event reaches whoever owns the partition.
	second := []eventline.Event{consumertest.Event("late", 1)}
	publish(t, k.brokers, k.topic, messagesOf(t, second)...)
	eventually(t, 60*time.Second, func() bool { return len(k.Effects(t, group)) == len(first)+1 }, "the event after the rebalance is applied")
	require.NoError(t, a.stop())
	require.NoError(t, b.stop())
	appliedOnce(t, k.Effects(t, group), append(first, second...))
	require.EqualValues(t, len(first)+1, delivered.Load(),
		"no message was delivered twice: the finished batch's offsets were committed before the partition moved")
}

func groupState(t *testing.T, k kenv, group string) string {
	t.Helper()
	admin := clusterAdmin(t, k.brokers)
	defer admin.Close()
	gs, err := admin.DescribeConsumerGroups([]string{group})
	if err != nil || len(gs) != 1 {
		return ""
	}
	return gs[0].State
}

// TestRebalanceWhenAConsumerLeavesMidStream runs two consumers in one
// group, stalls one mid-stream (its handlers block with events in flight),
// makes it leave, and checks that every effect is applied once and in
// order: the partitions it held move to the other consumer, which also gets
// again the events whose offsets were not committed yet.
func TestRebalanceWhenAConsumerLeavesMidStream(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 4)
	const group = "rebalance"
	const aggregates, versions = 16, 25

	var applied [2]atomic.Int64
	var stall atomic.Bool
	release, stalled := make(chan struct{}), make(chan struct{})
	var stallOnce sync.Once
	aLogger, aStopping := watchLog(partitionStopping)
	var mu sync.Mutex
	appliedBy := map[string]map[int]bool{} // aggregate -> consumers that applied some of it
	newConsumer := func(i int) *consumer.Consumer {
		cfg := k.config(group)
		if i == 0 {
			cfg.Logger = aLogger
		}
		c := k.newConsumer(t, cfg)
		require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
			if i == 0 && stall.Load() {
				stallOnce.Do(func() { close(stalled) })
				<-release // consumer a stalls with this event in flight
			}
			if err := k.Apply(ctx, tx, group, e); err != nil {
				return err
			}
			middleware.AfterCommit(ctx, func() {
				applied[i].Add(1)
				mu.Lock()
				if appliedBy[e.AggregateID] == nil {
					appliedBy[e.AggregateID] = map[int]bool{}
				}
				appliedBy[e.AggregateID][i] = true
				mu.Unlock()
			})
			return nil
		}))
		return c
	}
	a, b := start(t, newConsumer(0)), start(t, newConsumer(1))

	events := make([][]eventline.Event, aggregates)
	var want []eventline.Event
	for i := range events {
		for v := int64(1); v <= versions; v++ {
			e := consumertest.Event(fmt.Sprintf("agg-%02d", i), v)
			events[i] = append(events[i], e)
			want = append(want, e)
		}
	}
	round := func(v int) {
		var msgs []*message.Message
		for i := range events {
			msgs = append(msgs, consumertest.Message(t, events[i][v]))
		}
		publish(t, k.brokers, k.topic, msgs...)
	}
	// Publish a version of every aggregate per round until both consumers
	// have partitions (each has applied something).
	next := 0
	for ; next < versions && (applied[0].Load() == 0 || applied[1].Load() == 0); next++ {
		round(next)
		deadline := time.Now().Add(2 * time.Second)
		for time.Now().Before(deadline) && (applied[0].Load() == 0 || applied[1].Load() == 0) {
			time.Sleep(20 * time.Millisecond) // polling interval
		}
	}
	require.True(t, applied[0].Load() > 0 && applied[1].Load() > 0, "both consumers got partitions")
	// From now on a stalls: its partitions keep events pending.
	stall.Store(true)
	for ; next < versions; next++ {
		round(next)
	}

	// Consumer a leaves mid-stream, with an event in its handler; its
	// in-flight events are released once its partitions have begun to
	// stop, commit, but are never acknowledged.
	waitFor(t, stalled, 60*time.Second, "consumer a holds an event in flight")
	aStoppingNow := aStopping.Next()
	stopped := make(chan error, 1)
	go func() { stopped <- a.stop() }()
	waitFor(t, aStoppingNow, 60*time.Second, "consumer a's partitions stop")
	require.Positive(t, aStopping.MaxInt("events"), "a partition of consumer a stopped with events in flight")
	close(release)
	require.NoError(t, <-stopped)

	eventually(t, 90*time.Second, func() bool { return len(k.Effects(t, group)) >= len(want) }, "b applies the rest")
	require.NoError(t, b.stop())
	appliedOnce(t, k.Effects(t, group), want)
	handedOver := 0
	for _, by := range appliedBy {
		if by[0] && by[1] {
			handedOver++
		}
	}
	require.Positive(t, handedOver, "b continued aggregates a had started")
	var all []int64
	for v := int64(1); v <= versions; v++ {
		all = append(all, v)
	}
	for i := range events {
		value, last := k.State(t, group, "thing", fmt.Sprintf("agg-%02d", i))
		require.EqualValues(t, versions, last)
		require.Equal(t, fold(all...), value)
	}
}
