package consumer

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCoalescerTakesWaitingEventsOfLivePartitionsOnly checks the slots'
// bookkeeping: a free slot delivers at once, a busy one queues; a slot
// that frees takes up to the batch size of waiting events, in order,
// drops (answers abandoned) the waiting events of stopped partitions
// instead of delivering them, and frees itself when nothing is left; a
// withdrawn event is never taken.
func TestCoalescerTakesWaitingEventsOfLivePartitionsOnly(t *testing.T) {
	live := &partitionRun{topic: "t", stop: make(chan struct{})}
	revoked := &partitionRun{topic: "t", stop: make(chan struct{})}
	rec := func(off int64) *record { return &record{offset: off} }
	c := newCoalescer(1, 2)

	require.Nil(t, c.submit(live, rec(0)), "a free slot: delivered at once")
	l1 := c.submit(live, rec(1))
	r2 := c.submit(revoked, rec(2))
	l3 := c.submit(live, rec(3))
	l4 := c.submit(live, rec(4))
	l5 := c.submit(live, rec(5))
	for _, h := range []*handoff{l1, r2, l3, l4, l5} {
		require.NotNil(t, h, "every slot busy: the event waits")
	}
	require.True(t, c.withdraw(l4), "a waiting event can be withdrawn")
	require.False(t, c.withdraw(l4), "once")

	close(revoked.stop)
	require.Equal(t, []*handoff{l1, l3}, c.next(), "up to the batch size, of the live partition, in order")
	select {
	case a := <-r2.res:
		require.Equal(t, abandoned, a, "the revoked partition's event is dropped")
	default:
		t.Fatal("the revoked partition's waiting event got no answer")
	}
	require.False(t, c.withdraw(l3), "a taken event cannot be withdrawn")
	require.Equal(t, []*handoff{l5}, c.next())
	require.Nil(t, c.next(), "nothing waits: the slot frees")
	require.Zero(t, c.busy)
	require.Nil(t, c.submit(live, rec(6)), "the freed slot is taken at once")

	// The partition stops while its event waits: the lane withdraws it.
	h := c.submit(live, rec(7))
	require.NotNil(t, h)
	close(live.stop)
	require.Equal(t, abandoned, c.wait(h))
	require.Empty(t, c.waiting)
}
