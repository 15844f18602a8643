package middleware

import (
	"context"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
)

// Batch lets the composed middleware apply several events in one
// transaction. Watermill has no batch API: a Router runs each message
// through the middleware chain on its own goroutine. A subscriber that hands
// out several messages at once (the consumer package's Subscriber does, per
// lane of a Kafka partition) puts each in a Batch with [Batch.Add]; the
// composed middleware ([Eventline.Middleware]) then holds every member that
// reaches it until the batch is complete, and applies them together:
//
//   - BEGIN and every member's admission (dedup record, version lock, check
//     and advance) travel in one round trip, in the members' order, so two
//     events of one aggregate in one batch are admitted as they would be
//     one after the other;
//   - the gate's decision and the handler run for each member in order, in
//     the same transaction; then one COMMIT; then each member's
//     after-commit hooks (metrics) and its chain returns, so the router
//     acknowledges it only once its effects are committed.
//
// Per-event semantics are those of the one-event path: once-only effects,
// per-aggregate order, parking and draining, stale and duplicate discards,
// metrics per event. When a member's gate decision would change what a later
// member of the same aggregate is admitted as (it parks, or drains parked
// successors), the batch is cut before that later member and the rest runs
// as a new batch. Admissions are queued by aggregate, for lock order, and
// an event id is recorded per aggregate, so of two members with one id the
// first to arrive wins, as one at a time. A member whose gate step or handler fails or panics costs
// only itself: the transaction rolls back, the members before it are
// applied again as a batch, the failing one gets its error back (its retry
// and dead-letter middleware take over, one event at a time) and, once its
// message has left the chain ([Batch.Leave]), the members after it run as a
// new batch. When the database itself fails (BEGIN, the admissions or
// COMMIT), every member runs on its own, one after the other, through the
// one-event path.
//
// Members that never reach the composed middleware (rejected by a middleware
// in front of it) simply leave the batch. Middleware in front of the
// composed middleware sees a batch's members concurrently; the handler
// behind it sees them one at a time, in order.
//
// The subscriber's part, in order: Add a context per message and deliver
// the messages; Seal the batch; call Run (it returns once every member
// reached the middleware or left, and every member that reached it has its
// answer); call Leave for each message when its chain has returned (the
// message was acknowledged or nacked). A Batch is used once.
type Batch struct {
	mu      sync.Mutex
	slots   []*batchSlot
	sealed  bool
	started bool // Run took the members: later arrivals go alone

	joined   chan struct{} // closed when the first member arrives
	joinOnce sync.Once
	wake     chan struct{} // cap 1: something changed
}

// NewBatch returns an empty batch.
func NewBatch() *Batch {
	return &Batch{joined: make(chan struct{}), wake: make(chan struct{}, 1)}
}

type batchKey struct{}

// batchSlot is one member of a batch.
type batchSlot struct {
	b       *Batch
	index   int
	arrival *arrival      // the event waiting at the middleware
	left    chan struct{} // closed by Leave
	leftNow bool          // under b.mu
}

// arrival is an event waiting for its batch.
type arrival struct {
	slot  *batchSlot
	el    *Eventline
	msg   *message.Message
	e     eventline.Event
	h     message.HandlerFunc
	reply chan batchReply // cap 1

	answered bool // owned by the goroutine running the batch
}

// batchReply answers an arrival: its result, or alone: run the event on
// its own.
type batchReply struct {
	out   []*message.Message
	err   error
	alone bool
}

// Add adds a member and returns the context to give its message
// (msg.SetContext), derived from ctx. After Seal it returns ctx unchanged:
// the message is then applied on its own.
func (b *Batch) Add(ctx context.Context) context.Context {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.sealed {
		return ctx
	}
	s := &batchSlot{b: b, index: len(b.slots), left: make(chan struct{})}
	b.slots = append(b.slots, s)
	return context.WithValue(ctx, batchKey{}, s)
}

// Joined is closed when a member has reached the composed middleware:
// the chain the messages run through has one, so the batch can be filled.
// A subscriber that cannot know its chain sends the first member alone and
// the rest only after Joined, so a chain without the middleware still sees
// a lane's messages one at a time.
func (b *Batch) Joined() <-chan struct{} { return b.joined }

// Seal closes the batch to new members.
func (b *Batch) Seal() {
	b.mu.Lock()
	b.sealed = true
	b.mu.Unlock()
	b.poke()
}

// Leave tells the batch that member i's message has left the middleware
// chain (acknowledged or nacked), whether or not it reached the composed
// middleware. It is idempotent.
func (b *Batch) Leave(i int) {
	b.mu.Lock()
	if i < 0 || i >= len(b.slots) || b.slots[i].leftNow {
		b.mu.Unlock()
		return
	}
	s := b.slots[i]
	s.leftNow = true
	close(s.left)
	b.mu.Unlock()
	b.poke()
}

func (b *Batch) poke() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// Run waits until the batch is sealed and every member has reached the
// composed middleware or left, then applies the members that reached it
// (see [Batch]). It returns when each of them has its answer; when members
// run one after the other (after a failure), it also waits for each to
// leave before answering the next.
//
// When ctx ends, Run stops waiting: members still waiting are told to run
// on their own (their own contexts decide whether that can still succeed),
// and the batch's transaction, if one is open, is rolled back. Cancel ctx
// when the messages are abandoned (a partition revoked, a shutdown timeout).
func (b *Batch) Run(ctx context.Context) {
	items, ok := b.gather(ctx)
	if !ok {
		for _, it := range items {
			it.answer(batchReply{alone: true})
		}
		return
	}
	switch {
	case len(items) == 0:
	case len(items) == 1:
		items[0].answer(batchReply{alone: true})
	case !sameEventline(items):
		b.oneByOne(ctx, items)
	default:
		items[0].el.runBatch(ctx, b, items)
	}
}

// gather waits until the batch is complete and returns its arrivals in
// member order; ok is false when ctx ended first.
func (b *Batch) gather(ctx context.Context) (items []*arrival, ok bool) {
	for {
		b.mu.Lock()
		complete := b.sealed
		for _, s := range b.slots {
			if s.arrival == nil && !s.leftNow {
				complete = false
				break
			}
		}
		if complete || ctx.Err() != nil {
			b.started = true
			for _, s := range b.slots {
				if s.arrival != nil {
					items = append(items, s.arrival)
				}
			}
			b.mu.Unlock()
			return items, complete
		}
		b.mu.Unlock()
		select {
		case <-b.wake:
		case <-ctx.Done():
		}
	}
}

// oneByOne answers the arrivals one after the other: each runs on its own,
// and the next is released once the previous one's message has left the
// chain. It returns false when ctx ended first (the rest were released at
// once).
func (b *Batch) oneByOne(ctx context.Context, items []*arrival) bool {
	for i, it := range items {
		it.answer(batchReply{alone: true})
		if !it.waitLeft(ctx) {
			return abandon(items[i+1:])
		}
	}
	return true
}

func sameEventline(items []*arrival) bool {
	for _, it := range items[1:] {
		if it.el != items[0].el {
			return false
		}
	}
	return true
}

// slotFromContext returns the batch member a message belongs to, or nil.
func slotFromContext(ctx context.Context) *batchSlot {
	s, _ := ctx.Value(batchKey{}).(*batchSlot)
	return s
}

// arrive waits at the composed middleware for the member's batch. alone is
// true when the event must run on its own: the batch has already started
// (this is a retry, or a late arrival), or the batch decided so.
func (s *batchSlot) arrive(el *Eventline, msg *message.Message, e eventline.Event, h message.HandlerFunc) (out []*message.Message, err error, alone bool) {
	b := s.b
	b.mu.Lock()
	if b.started || s.arrival != nil || s.leftNow {
		b.mu.Unlock()
		return nil, nil, true
	}
	msg.SetContext(ContextWithEvent(msg.Context(), e))
	a := &arrival{slot: s, el: el, msg: msg, e: e, h: h, reply: make(chan batchReply, 1)}
	s.arrival = a
	b.mu.Unlock()
	b.joinOnce.Do(func() { close(b.joined) })
	b.poke()
	r := <-a.reply
	return r.out, r.err, r.alone
}

// answer sends the arrival its reply; only the first answer counts.
func (a *arrival) answer(r batchReply) {
	if a.answered {
		return
	}
	a.answered = true
	a.reply <- r
}

// waitLeft waits until the arrival's message has left the chain; false
// when ctx ended first.
func (a *arrival) waitLeft(ctx context.Context) bool {
	select {
	case <-a.slot.left:
		return true
	case <-ctx.Done():
		return false
	}
}
