package consumer_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/middleware"
)

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
