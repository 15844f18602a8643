package delivery

import (
	"context"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline"
)

// Batch lets the eventline middleware apply several events in one
// transaction (see the middleware package's documentation, "Batches"):
// the consumer's subscriber puts each of a lane's waiting events in a Batch
// with [Batch.Add]; the middleware holds every member that reaches it
// ([Slot.Arrive]) until the batch is complete and applies them together
// (its [Runner]), answering each member only once its effects are
// committed. How a member that parks, drains or fails is isolated is the
// runner's business (the middleware's runBatch).
//
// Members that never reach the middleware (rejected by a middleware in
// front of it) simply leave the batch. Middleware in front of the
// eventline middleware sees a batch's members concurrently; the handler
// behind it sees them one at a time, in order.
//
// The subscriber's part, in order: Add a context per message and deliver
// the messages; Seal the batch; call Run (it returns once every member
// reached the middleware or left, and every member that reached it has its
// answer); call Leave for each message when its chain has returned (the
// message was acknowledged or nacked). A Batch is used once.
type Batch struct {
	mu      sync.Mutex
	slots   []*Slot
	sealed  bool
	started bool // Run took the members: later arrivals go alone

	wake chan struct{} // cap 1: something changed
}

// NewBatch returns an empty batch.
func NewBatch() *Batch {
	return &Batch{wake: make(chan struct{}, 1)}
}

// Runner applies the arrivals of one batch (in member order) and answers
// every one of them; it returns false when ctx ended, having told every
// arrival not answered yet to run on its own ([Abandon]).
type Runner func(ctx context.Context, b *Batch, items []*Arrival) bool

type batchKey struct{}

// Slot is one member of a batch.
type Slot struct {
	b       *Batch
	arrival *Arrival      // the event waiting at the middleware
	left    chan struct{} // closed by Leave
	leftNow bool          // under b.mu
}

// Arrival is an event waiting at the middleware for its batch.
type Arrival struct {
	// Msg is the member's message, its context carrying the event; Event
	// the decoded event; Handler what runs inside the middleware.
	Msg     *message.Message
	Event   eventline.Event
	Handler message.HandlerFunc

	slot  *Slot
	owner any // the middleware that took it
	run   Runner
	reply chan Reply // cap 1

	answered bool // owned by the goroutine running the batch
}

// Reply answers an arrival: its result, or Alone: run the event on its
// own.
type Reply struct {
	Out   []*message.Message
	Err   error
	Alone bool
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
	s := &Slot{b: b, left: make(chan struct{})}
	b.slots = append(b.slots, s)
	return context.WithValue(ctx, batchKey{}, s)
}

// Seal closes the batch to new members.
func (b *Batch) Seal() {
	b.mu.Lock()
	b.sealed = true
	b.mu.Unlock()
	b.poke()
}

// Leave tells the batch that member i's message has left the middleware
// chain (acknowledged or nacked), whether or not it reached the
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
// middleware or left, then has the members that reached it applied by
// their middleware's Runner. It returns when each of them has its answer;
// when members run one after the other (after a failure), it also waits
// for each to leave before answering the next.
//
// When ctx ends, Run stops waiting: members still waiting are told to run
// on their own (their own contexts decide whether that can still succeed),
// and the batch's transaction, if one is open, is rolled back. Cancel ctx
// when the messages are abandoned (a partition revoked, a shutdown timeout).
func (b *Batch) Run(ctx context.Context) {
	items, ok := b.gather(ctx)
	if !ok {
		Abandon(items)
		return
	}
	switch {
	case len(items) == 0:
	case len(items) == 1:
		items[0].Answer(Reply{Alone: true})
	case !sameOwner(items):
		b.OneByOne(ctx, items)
	default:
		items[0].run(ctx, b, items)
	}
}

// Members returns how many members have reached the middleware and wait
// there for the batch (tests wait on it instead of sleeping).
func (b *Batch) Members() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, s := range b.slots {
		if s.arrival != nil {
			n++
		}
	}
	return n
}

// gather waits until the batch is complete and returns its arrivals in
// member order; ok is false when ctx ended first.
func (b *Batch) gather(ctx context.Context) (items []*Arrival, ok bool) {
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

// OneByOne answers the arrivals one after the other: each runs on its own,
// and the next is released once the previous one's message has left the
// chain. It returns false when ctx ended first (the rest were released at
// once).
func (b *Batch) OneByOne(ctx context.Context, items []*Arrival) bool {
	for i, it := range items {
		it.Answer(Reply{Alone: true})
		if !it.WaitLeft(ctx) {
			return Abandon(items[i+1:])
		}
	}
	return true
}

// Abandon tells every arrival not answered yet to run on its own; it
// returns false, for a Runner to return.
func Abandon(items []*Arrival) bool {
	for _, it := range items {
		it.Answer(Reply{Alone: true})
	}
	return false
}

func sameOwner(items []*Arrival) bool {
	for _, it := range items[1:] {
		if it.owner != items[0].owner {
			return false
		}
	}
	return true
}

// SlotOf returns the batch member the message of ctx belongs to, or nil.
func SlotOf(ctx context.Context) *Slot {
	s, _ := ctx.Value(batchKey{}).(*Slot)
	return s
}

// Arrive waits at the middleware (owner, which applies batches with run)
// for the member's batch. alone is true when the event must run on its
// own: the batch has already started (this is a retry, or a late
// arrival), or the batch decided so.
func (s *Slot) Arrive(owner any, run Runner, msg *message.Message, e eventline.Event, h message.HandlerFunc) (out []*message.Message, err error, alone bool) {
	b := s.b
	b.mu.Lock()
	if b.started || s.arrival != nil || s.leftNow {
		b.mu.Unlock()
		return nil, nil, true
	}
	a := &Arrival{Msg: msg, Event: e, Handler: h, slot: s, owner: owner, run: run, reply: make(chan Reply, 1)}
	s.arrival = a
	b.mu.Unlock()
	b.poke()
	r := <-a.reply
	return r.Out, r.Err, r.Alone
}

// Answer sends the arrival its reply; only the first answer counts.
func (a *Arrival) Answer(r Reply) {
	if a.answered {
		return
	}
	a.answered = true
	a.reply <- r
}

// WaitLeft waits until the arrival's message has left the chain; false
// when ctx ended first.
func (a *Arrival) WaitLeft(ctx context.Context) bool {
	select {
	case <-a.slot.left:
		return true
	case <-ctx.Done():
		return false
	}
}
