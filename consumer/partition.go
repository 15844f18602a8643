package consumer

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline/internal/delivery"
)

// minWindow is the least number of messages a partition keeps in flight
// (queued in its lanes or being handled); the window is larger when lanes
// × batch size need it.
const minWindow = 256

// hardKey carries, in the contexts of messages the subscriber delivers,
// its partition's hard context (partitionRun.hard).
type hardKey struct{}

// either returns a context that ends when a or b (if not nil) ends, and
// the function that releases it.
func either(a, b context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(a)
	if b == nil {
		return ctx, cancel
	}
	stop := context.AfterFunc(b, cancel)
	return ctx, func() {
		stop()
		cancel()
	}
}

// record is one Kafka record on its way through a lane.
type record struct {
	offset int64
	key    []byte    // the Kafka key
	at     time.Time // the record's timestamp
	lane   string    // what keeps it in one lane (see laneKey)
	msg    *message.Message
	sent   bool // msg has been delivered once: send a copy next time
}

// ack is how a delivered message came back.
type ack int

const (
	acked ack = iota
	nacked
	abandoned // the partition stopped waiting for it
)

// partitionRun runs one claimed partition: a dispatcher (ConsumeClaim's
// goroutine) hands records to lanes by aggregate; each lane delivers its
// records one at a time or in batches and settles their offsets.
type partitionRun struct {
	sub       *subscription
	cfg       Config
	sess      sarama.ConsumerGroupSession
	topic     string
	partition int32

	stop chan struct{} // closed: start nothing new
	halt context.Context
	// soft ends with halt or when the consumer's shutdown begins: the
	// messages' contexts (retries and waits stop); hard ends with halt or
	// when the consumer abandons in-flight work: the context their
	// transactions run under (Consumer.detach). Made once per partition,
	// so a message costs no registration with the consumer's contexts.
	soft, hard context.Context
	abandon    context.CancelFunc // cancels halt: stop waiting, cancel messages
	window     chan struct{}      // one token per record in flight

	mu       sync.Mutex
	tracker  *offsetTracker
	assigner *laneAssigner

	lanes []*lane
	wg    sync.WaitGroup
}

func newPartitionRun(sub *subscription, sess sarama.ConsumerGroupSession, topic string, partition int32) *partitionRun {
	cfg := sub.s.cfg
	p := &partitionRun{
		sub: sub, cfg: cfg, sess: sess, topic: topic, partition: partition,
		stop:     make(chan struct{}),
		window:   make(chan struct{}, max(minWindow, 2*cfg.Lanes*cfg.BatchSize)),
		tracker:  newOffsetTracker(),
		assigner: newLaneAssigner(cfg.Lanes),
	}
	halt, cancelHalt := context.WithCancel(context.Background())
	soft, releaseSoft := either(halt, sub.s.soft)
	hard, releaseHard := either(halt, sub.s.hard)
	p.halt, p.soft, p.hard = halt, soft, hard
	p.abandon = func() {
		cancelHalt()
		releaseSoft()
		releaseHard()
	}
	for range cfg.Lanes {
		p.lanes = append(p.lanes, &lane{p: p, signal: make(chan struct{}, 1)})
	}
	return p
}

func (p *partitionRun) start() {
	for _, l := range p.lanes {
		p.wg.Add(1)
		go l.run()
	}
}

// dispatch hands the claim's records to lanes until the claim ends (the
// partition is revoked or the session stops).
func (p *partitionRun) dispatch(claim sarama.ConsumerGroupClaim) {
	records := claim.Messages()
	done := p.sess.Context().Done()
	for {
		var km *sarama.ConsumerMessage
		select {
		case m, ok := <-records:
			if !ok {
				return
			}
			km = m
		case <-done:
			return
		}
		select {
		case p.window <- struct{}{}:
		case <-done:
			return
		}
		msg, err := kafka.DefaultMarshaler{}.Unmarshal(km)
		if err != nil {
			p.cfg.Logger.Error("eventline: cannot read a Kafka record; the partition stops until the next rebalance",
				"group", p.cfg.Group, "topic", p.topic, "partition", p.partition, "offset", km.Offset, "error", err)
			return
		}
		d := &record{offset: km.Offset, key: km.Key, at: km.Timestamp, lane: laneKey(km, msg), msg: msg}
		p.mu.Lock()
		p.tracker.add(km.Offset)
		l := p.lanes[p.assigner.assign(d.lane)]
		p.mu.Unlock()
		l.push(d)
	}
}

// settle stops the lanes: nothing new starts; what is in flight gets the
// drain timeout to be acknowledged, then is abandoned.
func (p *partitionRun) settle() {
	close(p.stop)
	if p.cfg.Logger.Enabled(context.Background(), slog.LevelDebug) {
		p.mu.Lock()
		n := p.tracker.unfinished()
		p.mu.Unlock()
		p.cfg.Logger.Debug("eventline: partition stopping (revoked, or the consumer is closing); finishing its in-flight events",
			"group", p.cfg.Group, "topic", p.topic, "partition", p.partition, "events", n, "timeout", p.sub.drainTimeout())
	}
	lanesDone := make(chan struct{})
	go func() {
		p.wg.Wait()
		close(lanesDone)
	}()
	timer := time.NewTimer(p.sub.drainTimeout())
	defer timer.Stop()
	select {
	case <-lanesDone:
	case <-timer.C:
		p.mu.Lock()
		n := p.tracker.unfinished()
		p.mu.Unlock()
		p.cfg.Logger.Warn("eventline: in-flight events did not finish in time; abandoning them (they roll back and are redelivered)",
			"group", p.cfg.Group, "topic", p.topic, "partition", p.partition, "events", n)
	}
	p.abandon()
	<-lanesDone
}

// closed reports whether ch is closed (it is never sent on).
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// send delivers d to the router: its own message the first time, a copy
// after that (Watermill's Ack and Nack settle a message once), with a
// context that ends when the consumer's shutdown begins or the partition
// abandons its in-flight messages (soft) and says where the record came
// from (delivery.SourceOf: dead letters record it), as a member of b when
// b is not nil. It returns nil when the partition abandoned its messages
// first.
func (p *partitionRun) send(d *record, b *delivery.Batch) *message.Message {
	msg := d.msg
	if d.sent {
		msg = d.msg.Copy()
	}
	d.sent = true
	ctx := delivery.WithSource(context.WithValue(p.soft, hardKey{}, p.hard),
		delivery.Source{Topic: p.topic, FromKafka: true, Partition: p.partition, Offset: d.offset, Key: d.key, Timestamp: d.at})
	if b != nil {
		ctx = b.Add(ctx)
	}
	msg.SetContext(ctx)
	select {
	case p.sub.out <- msg:
		return msg
	case <-p.halt.Done():
		return nil
	}
}

// await waits for msg, which delivers d, to be acknowledged or nacked;
// an acknowledged record is settled (finish: its offset may move at once).
func (p *partitionRun) await(msg *message.Message, d *record) ack {
	select {
	case <-msg.Acked():
		p.finish(d)
		return acked
	case <-msg.Nacked():
		return nacked
	case <-p.halt.Done():
		return abandoned
	}
}

// finish settles an acknowledged record: its offset counts as done, and
// the partition's committed offset moves to the lowest unfinished one.
func (p *partitionRun) finish(d *record) {
	p.mu.Lock()
	commit, moved := p.tracker.finish(d.offset)
	p.assigner.finish(d.lane)
	p.mu.Unlock()
	<-p.window
	if moved {
		p.sess.MarkOffset(p.topic, p.partition, commit, "")
		if !p.cfg.SaramaConfig.Consumer.Offsets.AutoCommit.Enable {
			p.sess.Commit()
		}
	}
}

// lane delivers the records of the aggregates assigned to it, in offset
// order.
type lane struct {
	p      *partitionRun
	mu     sync.Mutex
	queue  []*record
	signal chan struct{} // cap 1: queue grew
}

func (l *lane) push(d *record) {
	l.mu.Lock()
	l.queue = append(l.queue, d)
	l.mu.Unlock()
	select {
	case l.signal <- struct{}{}:
	default:
	}
}

// take removes up to n deliveries from the head of the queue.
func (l *lane) take(n int) []*record {
	l.mu.Lock()
	defer l.mu.Unlock()
	n = min(n, len(l.queue))
	if n == 0 {
		return nil
	}
	out := append([]*record(nil), l.queue[:n]...)
	clear(l.queue[:n])
	l.queue = l.queue[n:]
	return out
}

// next waits for the next record; nil when the partition stops.
func (l *lane) next() *record {
	for {
		if closed(l.p.stop) {
			return nil
		}
		if ds := l.take(1); len(ds) == 1 {
			return ds[0]
		}
		select {
		case <-l.signal:
		case <-l.p.stop:
			return nil
		}
	}
}

func (l *lane) run() {
	defer l.p.wg.Done()
	for {
		d := l.next()
		if d == nil {
			return
		}
		if l.p.cfg.BatchSize > 1 {
			l.deliverBatch(d)
		} else {
			l.deliverOne(d)
		}
	}
}

// deliverOne delivers d alone, again after each nack, until it is
// acknowledged, the partition stops or abandons it.
func (l *lane) deliverOne(d *record) {
	for {
		if l.p.attempt(d) != nacked || !l.pause() {
			return
		}
	}
}

// attempt delivers d alone once and waits for its answer.
func (p *partitionRun) attempt(d *record) ack {
	if msg := p.send(d, nil); msg != nil {
		return p.await(msg, d)
	}
	return abandoned
}

// sendMember sends d as member i of batch b and, once its answer is known
// (and d settled, see await), leaves the batch and tells report; at once,
// abandoned, when the partition stops before d is sent.
func (p *partitionRun) sendMember(b *delivery.Batch, i int, d *record, report func(ack)) {
	msg := p.send(d, b)
	if msg == nil {
		b.Leave(i)
		report(abandoned)
		return
	}
	go func() {
		a := p.await(msg, d)
		b.Leave(i)
		report(a)
	}()
}

// handOff delivers d, the lane's only ready event, through the
// subscription's coalescer, and waits for its outcome; a nacked d is
// delivered again by the lane, alone, after a pause.
func (l *lane) handOff(d *record) {
	p := l.p
	c := p.sub.coalesce
	var a ack
	if h := c.submit(p, d); h == nil {
		a = p.attempt(d)
		c.done()
	} else {
		a = c.wait(h)
	}
	if a == nacked && l.pause() {
		l.deliverOne(d)
	}
}

// pause waits before a nacked message is delivered again; false when the
// partition stops meanwhile (the message is then left for redelivery).
func (l *lane) pause() bool {
	t := time.NewTimer(nackResendPause)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-l.p.stop:
		return false
	}
}

type memberResult struct {
	index int
	ack   ack
}

// deliverBatch delivers first and what is queued behind it as one batch
// (internal/delivery.Batch), which the eventline middleware in the chain
// applies in one transaction.
func (l *lane) deliverBatch(first *record) {
	p := l.p
	cfg := p.cfg
	more := l.take(cfg.BatchSize - 1)
	if len(more) == 0 && cfg.BatchLinger == 0 {
		if p.sub.coalesce != nil {
			l.handOff(first)
		} else {
			l.deliverOne(first)
		}
		return
	}
	b := delivery.NewBatch()
	results := make(chan memberResult, cfg.BatchSize)
	var members []*record
	add := func(d *record) {
		i := len(members)
		members = append(members, d)
		p.sendMember(b, i, d, func(a ack) { results <- memberResult{i, a} })
	}
	add(first)
	for _, d := range more {
		add(d)
	}
	l.fill(add, len(members))
	b.Seal()
	b.Run(p.halt)
	got := make([]ack, len(members))
	for range members {
		r := <-results
		got[r.index] = r.ack
	}
	for i, d := range members {
		if got[i] != nacked {
			continue
		}
		if !l.pause() {
			return
		}
		l.deliverOne(d)
	}
}

// fill adds to the batch what the lane received meanwhile: without a
// linger, what is queued now; with one, what arrives until it expires,
// until the batch is full.
func (l *lane) fill(add func(*record), n int) {
	cfg := l.p.cfg
	for _, d := range l.take(cfg.BatchSize - n) {
		add(d)
		n++
	}
	if cfg.BatchLinger == 0 || n >= cfg.BatchSize {
		return
	}
	t := time.NewTimer(cfg.BatchLinger)
	defer t.Stop()
	for n < cfg.BatchSize {
		select {
		case <-l.signal:
			for _, d := range l.take(cfg.BatchSize - n) {
				add(d)
				n++
			}
		case <-t.C:
			return
		case <-l.p.stop:
			return
		}
	}
}
