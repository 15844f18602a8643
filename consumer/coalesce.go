package consumer

import (
	"context"
	"runtime"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/eventline/eventline/internal/delivery"
)

// coalesceSlots is how many single events a subscription delivers at once
// before it starts coalescing them: min(the pool's MaxConns, max(lanes,
// 2 × GOMAXPROCS)). Without a pool size (a Pool that is not a
// *pgxpool.Pool) the pool bound is left out.
func coalesceSlots(db any, lanes int) int {
	n := max(lanes, 2*runtime.GOMAXPROCS(0))
	if p, ok := db.(interface{ Stat() *pgxpool.Stat }); ok {
		if s := p.Stat(); s != nil && s.MaxConns() > 0 {
			n = min(n, int(s.MaxConns()))
		}
	}
	return max(n, 1)
}

// coalescer is a subscription's pool of delivery slots for single events
// (see the package documentation, "Lanes and batches"): a lane with one
// ready event and nothing queued behind it hands the event over; a slot
// delivers it alone while one is free, else a slot that frees takes up to
// BatchSize waiting events (one topic: a subscription is one topic) and
// delivers them as one batch. The lane waits for its event's outcome
// (acked, nacked, abandoned) as if it had delivered it itself.
type coalescer struct {
	slots int // deliveries at once
	size  int // the most events in one delivery (BatchSize)

	mu      sync.Mutex
	busy    int
	waiting []*handoff

	wg sync.WaitGroup // goroutines delivering coalesced events

	// hook, when set, is told of each submitted event: alone (a slot was
	// free) or the number of events waiting with it (tests).
	hook func(alone bool, waiting int)
}

// handoff is a lane's event waiting for a slot.
type handoff struct {
	p   *partitionRun
	d   *record
	res chan ack // cap 1: the event's outcome
}

// submit takes a slot for d, returning nil: the caller delivers d alone at
// once and then calls done. When every slot is busy it queues d and
// returns its handoff: the caller waits for its outcome (wait).
func (c *coalescer) submit(p *partitionRun, d *record) *handoff {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.busy < c.slots {
		c.busy++
		if c.hook != nil {
			c.hook(true, len(c.waiting))
		}
		return nil
	}
	h := &handoff{p: p, d: d, res: make(chan ack, 1)}
	c.waiting = append(c.waiting, h)
	if c.hook != nil {
		c.hook(false, len(c.waiting))
	}
	return h
}

// done frees the caller's slot: the waiting events it takes, if any, are
// delivered on a goroutine of the coalescer.
func (c *coalescer) done() {
	if hs := c.next(); hs != nil {
		c.wg.Add(1)
		go c.run(hs)
	}
}

// next is called by a slot that frees: it returns up to size waiting
// events of live partitions (the slot stays busy), or nil and frees the
// slot. Waiting events of stopped partitions are dropped: their lanes get
// abandoned and leave them undelivered.
func (c *coalescer) next() []*handoff {
	c.mu.Lock()
	defer c.mu.Unlock()
	var take []*handoff
	keep := c.waiting[:0]
	for _, h := range c.waiting {
		switch {
		case closed(h.p.stop):
			h.res <- abandoned
		case len(take) < c.size && (len(take) == 0 || take[0].p.topic == h.p.topic):
			take = append(take, h)
		default:
			keep = append(keep, h)
		}
	}
	clear(c.waiting[len(keep):])
	c.waiting = keep
	if len(take) == 0 {
		c.busy--
		return nil
	}
	return take
}

// withdraw removes h from the waiting events; false when a slot already
// took it (or dropped it): its outcome is coming.
func (c *coalescer) withdraw(h *handoff) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, w := range c.waiting {
		if w == h {
			c.waiting = append(c.waiting[:i], c.waiting[i+1:]...)
			return true
		}
	}
	return false
}

// wait returns the outcome of h. When its partition stops first, an event
// still waiting for a slot is withdrawn (abandoned: it was not
// delivered).
func (c *coalescer) wait(h *handoff) ack {
	select {
	case a := <-h.res:
		return a
	case <-h.p.stop:
		if c.withdraw(h) {
			return abandoned
		}
		return <-h.res
	}
}

// run delivers hs, then what the slot takes next, until nothing waits.
func (c *coalescer) run(hs []*handoff) {
	defer c.wg.Done()
	for hs != nil {
		c.deliver(hs)
		hs = c.next()
	}
}

// deliver delivers hs (events of distinct lanes, perhaps of several
// partitions) as one batch, or alone when there is one, and hands each
// outcome to its lane as soon as it is known. Acknowledged events are
// settled (finish) here, as in a lane's batch.
func (c *coalescer) deliver(hs []*handoff) {
	if len(hs) == 1 {
		hs[0].res <- hs[0].p.attempt(hs[0].d)
		return
	}
	// The batch is abandoned (its transaction rolled back, its other
	// members applied alone) when any member's partition abandons its
	// messages.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	seen := map[*partitionRun]bool{}
	for _, h := range hs {
		if !seen[h.p] {
			seen[h.p] = true
			stop := context.AfterFunc(h.p.halt, cancel)
			defer stop()
		}
	}
	b := delivery.NewBatch()
	var members sync.WaitGroup
	members.Add(len(hs))
	for i, h := range hs {
		h.p.sendMember(b, i, h.d, func(a ack) {
			h.res <- a
			members.Done()
		})
	}
	b.Seal()
	b.Run(ctx)
	members.Wait()
}
