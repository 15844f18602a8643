package consumer

import (
	"context"
	"fmt"
	"runtime"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
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
	c := &coalescer{slots: 1, size: 2}

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

// TestCoalescerProperty drives a coalescer with random lanes of random
// partitions (each lane with at most one event handed over at a time, as
// a lane waits for its event's outcome), slots that free in any order and
// partitions that stop, and checks after every step: no more slots busy
// than there are; no event of a live partition waits while a slot is free
// (an event finds a free slot at once); a slot that frees takes the
// earliest waiting events of live partitions, at most the batch size;
// every event handed over is delivered, withdrawn or dropped exactly once,
// and a stopped partition's waiting events are never delivered.
func TestCoalescerProperty(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		slots := rapid.IntRange(1, 4).Draw(rt, "slots")
		size := rapid.IntRange(1, 5).Draw(rt, "size")
		c := &coalescer{slots: slots, size: size}
		type laneID struct{ p, l int }
		parts := make([]*partitionRun, rapid.IntRange(1, 3).Draw(rt, "partitions"))
		for i := range parts {
			parts[i] = &partitionRun{topic: "t", stop: make(chan struct{})}
		}
		const lanes = 4
		lane := map[*record]laneID{}
		busyLane := map[laneID]bool{} // the lane's event is handed over
		var waiting []*handoff        // the model's queue, in order
		var running [][]*record       // what each busy slot delivers
		var off int64
		settled := map[*record]string{}
		settle := func(d *record, how string) {
			if prev, ok := settled[d]; ok {
				rt.Fatalf("event %d %s, already %s", d.offset, how, prev)
			}
			settled[d] = how
			delete(busyLane, lane[d])
		}
		// free finishes slot i and lets it take what waits, as done and
		// run do.
		free := func(i int) {
			for _, d := range running[i] {
				settle(d, "delivered")
			}
			running = append(running[:i], running[i+1:]...)
			var want []*handoff
			var rest []*handoff
			for _, h := range waiting {
				switch {
				case closed(h.p.stop):
					if len(h.res) != 0 {
						rt.Fatalf("the waiting event %d was answered before a slot freed", h.d.offset)
					}
				case len(want) < size:
					want = append(want, h)
				default:
					rest = append(rest, h)
				}
			}
			got := c.next()
			for _, h := range waiting {
				if closed(h.p.stop) {
					select {
					case a := <-h.res:
						if a != abandoned {
							rt.Fatalf("dropped event %d answered %v", h.d.offset, a)
						}
					default:
						rt.Fatalf("the waiting event %d of a stopped partition got no answer", h.d.offset)
					}
					settle(h.d, "dropped")
				}
			}
			if len(got) != len(want) {
				rt.Fatalf("took %d events, want %d", len(got), len(want))
			}
			var batch []*record
			for j := range got {
				if got[j] != want[j] {
					rt.Fatalf("took event %d at %d, want %d", got[j].d.offset, j, want[j].d.offset)
				}
				batch = append(batch, got[j].d)
			}
			waiting = rest
			if len(got) > 0 {
				running = append(running, batch)
			}
		}
		for range rapid.IntRange(1, 100).Draw(rt, "steps") {
			switch rapid.IntRange(0, 5).Draw(rt, "op") {
			case 0, 1, 2: // a lane with a single event hands it over
				id := laneID{rapid.IntRange(0, len(parts)-1).Draw(rt, "partition"), rapid.IntRange(0, lanes-1).Draw(rt, "lane")}
				p := parts[id.p]
				if busyLane[id] || closed(p.stop) {
					continue
				}
				off++
				d := &record{offset: off}
				lane[d], busyLane[id] = id, true
				if h := c.submit(p, d); h == nil {
					running = append(running, []*record{d})
				} else {
					waiting = append(waiting, h)
				}
			case 3, 4: // a slot frees
				if len(running) > 0 {
					free(rapid.IntRange(0, len(running)-1).Draw(rt, "slot"))
				}
			case 5: // a partition stops; some of its lanes withdraw their events at once
				p := parts[rapid.IntRange(0, len(parts)-1).Draw(rt, "stop")]
				if closed(p.stop) {
					continue
				}
				close(p.stop)
				var rest []*handoff
				for _, h := range waiting {
					if h.p == p && rapid.Bool().Draw(rt, "withdraw") {
						if c.wait(h) != abandoned {
							rt.Fatalf("withdrawn event %d not abandoned", h.d.offset)
						}
						settle(h.d, "withdrawn")
						continue
					}
					rest = append(rest, h)
				}
				waiting = rest
			}
			if c.busy != len(running) || c.busy > slots {
				rt.Fatalf("%d slots busy, %d running, %d slots", c.busy, len(running), slots)
			}
			if len(c.waiting) != len(waiting) {
				rt.Fatalf("%d events waiting, want %d", len(c.waiting), len(waiting))
			}
			if c.busy < slots {
				for _, h := range c.waiting {
					if !closed(h.p.stop) {
						rt.Fatalf("event %d waits while a slot is free", h.d.offset)
					}
				}
			}
		}
		for len(running) > 0 {
			free(0)
		}
		if c.busy != 0 || len(c.waiting) != 0 {
			rt.Fatalf("at the end: %d slots busy, %d waiting", c.busy, len(c.waiting))
		}
		for d := range lane {
			if _, ok := settled[d]; !ok {
				rt.Fatalf("event %d never settled", d.offset)
			}
		}
	})
}

// TestCoalesceSlots checks the slot rule: min(the pool's MaxConns,
// max(lanes, 2 × GOMAXPROCS)), without the pool bound when the pool has no
// size to tell.
func TestCoalesceSlots(t *testing.T) {
	procs := runtime.GOMAXPROCS(0)
	pool := func(maxConns int) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(fmt.Sprintf("postgres://postgres@127.0.0.1:1/none?pool_max_conns=%d", maxConns))
		require.NoError(t, err)
		p, err := pgxpool.NewWithConfig(context.Background(), cfg) // connects lazily: never here
		require.NoError(t, err)
		t.Cleanup(p.Close)
		return p
	}
	require.Equal(t, max(8, 2*procs), coalesceSlots(nil, 8))
	require.Equal(t, max(64, 2*procs), coalesceSlots(nil, 64))
	require.Equal(t, max(1, 2*procs), coalesceSlots(nil, 1))
	require.Equal(t, 3, coalesceSlots(pool(3), 8), "the pool bounds the slots")
	require.Equal(t, max(8, 2*procs), coalesceSlots(pool(1000), 8))
}
