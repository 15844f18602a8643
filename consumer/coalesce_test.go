package consumer_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/kafkaconf"
)

// coalesceWatch records what a consumer's coalescer is told of the events
// handed to it.
type coalesceWatch struct {
	alone   atomic.Int32
	mu      sync.Mutex
	waiting int // the most events seen waiting for a slot at once
	changed chan struct{}
}

func watchCoalesce(c *consumer.Consumer, slots int) *coalesceWatch {
	w := &coalesceWatch{changed: make(chan struct{}, 1)}
	consumer.SetCoalesce(c, slots, func(alone bool, waiting int) {
		if alone {
			w.alone.Add(1)
		} else {
			w.mu.Lock()
			w.waiting = max(w.waiting, waiting)
			w.mu.Unlock()
		}
		select {
		case w.changed <- struct{}{}:
		default:
		}
	})
	return w
}

// waitWaiting waits up to timeout for n events to have waited for a slot
// at once; false if they did not.
func (w *coalesceWatch) waitWaiting(n int, timeout time.Duration) bool {
	deadline := time.After(timeout)
	for {
		w.mu.Lock()
		got := w.waiting
		w.mu.Unlock()
		if got >= n {
			return true
		}
		select {
		case <-w.changed:
		case <-deadline:
			return false
		}
	}
}

// slowFirst is a handler that holds the event of aggregate "slow" until
// release is closed (or its context ends), and applies every event.
func slowFirst(k kenv, group string, entered, release chan struct{}) consumer.HandlerFunc {
	var once sync.Once
	return func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		if e.AggregateID == "slow" {
			once.Do(func() { close(entered) })
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return k.Apply(ctx, tx, group, e)
	}
}

// publishToPartition publishes msgs, in order, to one partition of topic.
func publishToPartition(t *testing.T, brokers []string, topic string, partition int32, msgs ...*message.Message) {
	t.Helper()
	cfg := kafkaconf.Producer("test-partition")
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	p, err := sarama.NewSyncProducer(brokers, cfg)
	require.NoError(t, err)
	defer p.Close()
	for _, m := range msgs {
		pm, err := kafka.DefaultMarshaler{}.Marshal(topic, m)
		require.NoError(t, err)
		pm.Partition = partition
		pm.Key = sarama.StringEncoder(m.Metadata.Get(eventline.MetaAggregateID))
		_, _, err = p.SendMessage(pm)
		require.NoError(t, err)
	}
}

// heldSlot is a running consumer whose coalescer has slots slots, one of
// them held by the event of aggregate "slow" (published to partition 0)
// until release is called; release also runs at the test's end.
type heldSlot struct {
	c       *consumer.Consumer
	w       *coalesceWatch
	r       *running
	slow    eventline.Event
	release func()
}

func holdSlot(t *testing.T, k kenv, group string, cfg consumer.Config, slots int) heldSlot {
	t.Helper()
	c := k.newConsumer(t, cfg)
	w := watchCoalesce(c, slots)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h := heldSlot{c: c, w: w, slow: consumertest.Event("slow", 1), release: func() { once.Do(func() { close(release) }) }}
	t.Cleanup(h.release)
	require.NoError(t, c.Handle("thing.changed", slowFirst(k, group, entered, release)))
	publishToPartition(t, k.brokers, k.topic, 0, consumertest.Message(t, h.slow))
	h.r = start(t, c)
	waitFor(t, entered, 40*time.Second, "the slow event to take a slot")
	return h
}

// TestSingleEventsOfBusyLanesShareATransaction holds the coalescer's only
// slot with a slow event while single events of other lanes arrive: they
// wait for the slot and are then applied together, in one transaction,
// instead of one transaction each.
func TestSingleEventsOfBusyLanesShareATransaction(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "coalesce"
	cfg := k.config(group)
	cfg.Lanes, cfg.BatchSize = 8, 16
	h := holdSlot(t, k, group, cfg, 1)
	w, r, slow := h.w, h.r, h.slow

	var evs []eventline.Event
	for _, id := range []string{"a", "b", "c", "d", "e"} {
		evs = append(evs, consumertest.Event(id, 1))
	}
	publish(t, k.brokers, k.topic, messagesOf(t, evs)...)
	// Without a coalescer (the old runner) nobody waits: the events are
	// applied at once, one transaction each, and the checks below fail.
	if !w.waitWaiting(len(evs), 30*time.Second) {
		t.Log("the events did not wait for the slot")
	}
	require.Len(t, k.Effects(t, group), 0, "nothing applied while the slot is busy")
	h.release()
	eventually(t, 40*time.Second, func() bool { return len(k.Effects(t, group)) == 1+len(evs) }, "all applied")
	require.NoError(t, r.stop())

	appliedOnce(t, k.Effects(t, group), append([]eventline.Event{slow}, evs...))
	txs := k.Transactions(t, group)
	for _, e := range evs {
		require.Equal(t, txs[evs[0].ID], txs[e.ID], "the waiting single events share one transaction")
	}
	require.NotEqual(t, txs[slow.ID], txs[evs[0].ID])
	require.EqualValues(t, 1, w.alone.Load(), "only the slow event found a free slot")
}

// TestShutdownWithdrawsEventsWaitingForASlot stops the consumer while
// single events wait for the coalescer's slot: they are withdrawn, not
// applied and their offsets not committed, the event in flight finishes,
// and the next consumer applies the withdrawn ones once.
func TestShutdownWithdrawsEventsWaitingForASlot(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "coalesce-stop"
	logger, stopping := watchLog(partitionStopping)
	cfg := k.config(group)
	cfg.Lanes, cfg.BatchSize, cfg.Logger = 8, 16, logger
	h := holdSlot(t, k, group, cfg, 1)
	w, r, slow := h.w, h.r, h.slow
	var evs []eventline.Event
	for _, id := range []string{"a", "b", "c"} {
		evs = append(evs, consumertest.Event(id, 1))
	}
	publish(t, k.brokers, k.topic, messagesOf(t, evs)...)
	if !w.waitWaiting(len(evs), 30*time.Second) {
		t.Log("the events did not wait for the slot")
	}

	isStopping := stopping.Next()
	stopped := make(chan error, 1)
	go func() { stopped <- r.stop() }()
	waitFor(t, isStopping, 20*time.Second, "the partition to stop")
	h.release()
	select {
	case err := <-stopped:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	effects := k.Effects(t, group)
	require.Len(t, effects, 1, "only the event in flight was applied")
	require.Equal(t, slow.ID, effects[0].EventID)
	require.EqualValues(t, 1, committedOffset(t, k, group), "the offset stops at the first withdrawn event")

	c2 := k.newConsumer(t, k.config(group))
	require.NoError(t, c2.Handle("thing.changed", k.applyHandler(group)))
	r2 := start(t, c2)
	eventually(t, 40*time.Second, func() bool { return len(k.Effects(t, group)) == 1+len(evs) }, "the withdrawn events applied by the next consumer")
	require.NoError(t, r2.stop())
	appliedOnce(t, k.Effects(t, group), append([]eventline.Event{slow}, evs...))
}

// TestCoalescedBatchWithOneAggregateInTwoPartitions coalesces single
// events of two partitions that share aggregates and an event id (as a
// repartitioned topic or a misbehaving producer would): versions out of
// order across the partitions and the same event twice land in one
// coalesced batch, and each event is still applied once, in version
// order.
func TestCoalescedBatchWithOneAggregateInTwoPartitions(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 2)
	const group = "coalesce-parts"
	cfg := k.config(group)
	cfg.Lanes, cfg.BatchSize = 8, 16
	cfg.SweepInterval, cfg.ParkTimeout = time.Hour, time.Hour // no help from the sweeper
	h := holdSlot(t, k, group, cfg, 1)
	w, r, slow := h.w, h.r, h.slow

	x1, x2, y1, y2 := consumertest.Event("x", 1), consumertest.Event("x", 2), consumertest.Event("y", 1), consumertest.Event("y", 2)
	// Partition 0: x2 and y1; partition 1: x1 and y1 again (the same event
	// in both partitions). Each is its lane's only event: the four wait
	// for the slot together.
	publishToPartition(t, k.brokers, k.topic, 0, messagesOf(t, []eventline.Event{x2, y1})...)
	publishToPartition(t, k.brokers, k.topic, 1, messagesOf(t, []eventline.Event{x1, y1})...)
	require.True(t, w.waitWaiting(4, 40*time.Second), "the four single events wait for the slot together")
	publishToPartition(t, k.brokers, k.topic, 1, consumertest.Message(t, y2))
	h.release()
	eventually(t, 40*time.Second, func() bool { return len(k.Effects(t, group)) == 5 }, "every event applied without the sweeper")
	require.NoError(t, r.stop())

	appliedOnce(t, k.Effects(t, group), []eventline.Event{slow, x1, x2, y1, y2})
	for _, id := range []string{"x", "y"} {
		value, last := k.State(t, group, "thing", id)
		require.EqualValues(t, 2, last)
		require.Equal(t, fold(1, 2), value)
	}
	require.Equal(t, 0, k.Count(t, "parked_events", ""))
	require.Equal(t, 5, k.Count(t, "processed_events", ""))
}

// TestSingleEventStartsAtOnceWithAFreeSlot guards the idle path: while one
// of the coalescer's two slots is held by a slow event, a single event of
// another lane finds the free slot and is applied at once, alone, without
// waiting for the slow one.
func TestSingleEventStartsAtOnceWithAFreeSlot(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "coalesce-free"
	cfg := k.config(group)
	cfg.Lanes, cfg.BatchSize = 8, 16
	h := holdSlot(t, k, group, cfg, 2)
	w, r, slow := h.w, h.r, h.slow

	quick := consumertest.Event("quick", 1)
	published := time.Now()
	publish(t, k.brokers, k.topic, consumertest.Message(t, quick))
	eventually(t, 20*time.Second, func() bool { return len(k.Effects(t, group)) == 1 }, "the quick event applied while the slow one holds its slot")
	t.Logf("quick event applied %s after it was published", time.Since(published))
	require.EqualValues(t, 2, w.alone.Load(), "both events found a free slot and went alone")
	w.mu.Lock()
	require.Zero(t, w.waiting, "no event waited for a slot")
	w.mu.Unlock()
	h.release()
	eventually(t, 20*time.Second, func() bool { return len(k.Effects(t, group)) == 2 }, "the slow event applied")
	require.NoError(t, r.stop())
	appliedOnce(t, k.Effects(t, group), []eventline.Event{quick, slow})
}
