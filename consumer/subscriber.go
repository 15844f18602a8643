package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
)

// nackResendPause is the wait before a nacked message is delivered again
// (watermill-kafka's default).
const nackResendPause = 100 * time.Millisecond

// reconnectPause is the wait before joining the group again after an
// error.
const reconnectPause = time.Second

// subscriber is the consumer's Watermill subscriber for Kafka consumer
// groups: it hands out a partition's events by lanes and in batches (see
// the package documentation, "Lanes and batches"), which the eventline
// middleware in the Router's chain applies.
//
// Messages are decoded with watermill-kafka's DefaultMarshaler, so UUID,
// payload and metadata are what watermill-kafka's subscriber produces. The
// record's topic, partition, offset and key are in the message context as
// a delivery.Source (see send); watermill-kafka's own context accessors
// find nothing.
//
// Delivery and offsets:
//
//   - The offset committed for a partition is the lowest offset whose
//     message has not been acknowledged (see offsetTracker).
//   - A nacked message is delivered again, after a short pause, before
//     anything else of its lane.
//   - When a partition is revoked or the subscriber closes, no new message
//     is delivered; messages in flight get ShutdownTimeout (on revocation, at
//     most half the rebalance timeout) to be acknowledged, and their
//     offsets are committed; then the rest are abandoned: their contexts
//     are canceled (a batch transaction rolls back) and they will be
//     redelivered.
type subscriber struct {
	cfg Config // the consumer's, defaults filled in and validated
	// slots is how many single events (a lane's only ready event) a
	// subscription delivers at once before it coalesces them into batches
	// (see coalescer; Run passes coalesceSlots); 0 or below turns
	// coalescing off, and so does BatchSize 1.
	slots int
	// coalesceHook is the coalescer's hook (tests).
	coalesceHook func(alone bool, waiting int)
	// soft and hard are the consumer's shutdown contexts (see Consumer),
	// which end the contexts of the messages it delivers (see
	// partitionRun); nil: never.
	soft, hard context.Context

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	subs    []*subscription
}

// newSubscriber returns a subscriber; it connects to Kafka at Subscribe.
func newSubscriber(cfg Config, slots int, coalesceHook func(alone bool, waiting int), soft, hard context.Context) *subscriber {
	return &subscriber{cfg: cfg, slots: slots, coalesceHook: coalesceHook, soft: soft, hard: hard, closing: make(chan struct{})}
}

// errSubscriberClosed is Subscribe's error once the Subscriber is closed.
var errSubscriberClosed = errors.New("eventline: the consumer's subscriber is closed")

// subscription is one topic's consumer group membership.
type subscription struct {
	s      *subscriber
	topic  string
	group  sarama.ConsumerGroup
	out    chan *message.Message
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
	// coalesce delivers the single events of the subscription's lanes;
	// nil when they deliver them themselves.
	coalesce *coalescer
}

// Subscribe joins the consumer group for topic and returns the channel the
// topic's messages arrive on. The channel is closed when ctx ends or the
// subscriber closes, once in-flight messages are settled (see
// Config.ShutdownTimeout).
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, errSubscriberClosed
	}
	group, err := sarama.NewConsumerGroup(s.cfg.Brokers, s.cfg.Group, s.cfg.SaramaConfig)
	if err != nil {
		return nil, fmt.Errorf("eventline: join Kafka consumer group %q at %v: %w", s.cfg.Group, s.cfg.Brokers, err)
	}
	sub := &subscription{s: s, topic: topic, group: group, out: make(chan *message.Message), done: make(chan struct{})}
	if s.slots > 0 && s.cfg.BatchSize > 1 {
		sub.coalesce = &coalescer{slots: s.slots, size: s.cfg.BatchSize, hook: s.coalesceHook}
	}
	sub.ctx, sub.cancel = context.WithCancel(context.WithoutCancel(ctx))
	s.subs = append(s.subs, sub)
	go sub.run()
	go func() {
		select {
		case <-ctx.Done():
			sub.cancel()
		case <-sub.done:
		}
	}()
	return sub.out, nil
}

// Close stops every subscription: no new message is delivered, in-flight
// messages get ShutdownTimeout to be acknowledged (their offsets are then
// committed), the rest are abandoned. It returns when every goroutine of
// the subscriber has ended. It is idempotent.
func (s *subscriber) Close() error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.closing)
	}
	subs := append([]*subscription(nil), s.subs...)
	s.mu.Unlock()
	for _, sub := range subs {
		sub.cancel()
	}
	for _, sub := range subs {
		<-sub.done
	}
	return nil
}

// run consumes until the subscription's context ends, rejoining the group
// after every rebalance.
func (sub *subscription) run() {
	log := sub.s.cfg.Logger.With("group", sub.s.cfg.Group, "topic", sub.topic)
	errsDone := make(chan struct{})
	go func() {
		defer close(errsDone)
		for err := range sub.group.Errors() {
			log.Warn("eventline: Kafka consumer group error", "error", err)
		}
	}()
	defer func() {
		if err := sub.group.Close(); err != nil {
			log.Warn("eventline: leaving the Kafka consumer group failed", "error", err)
		}
		<-errsDone
		if sub.coalesce != nil {
			// Every partition has stopped: what the coalescer still
			// delivers was abandoned and returns at once.
			sub.coalesce.wg.Wait()
		}
		close(sub.out)
		close(sub.done)
	}()
	h := &groupHandler{sub: sub}
	for sub.ctx.Err() == nil {
		err := sub.group.Consume(sub.ctx, []string{sub.topic}, h)
		switch {
		case sub.ctx.Err() != nil, errors.Is(err, sarama.ErrClosedConsumerGroup):
			return
		case err != nil:
			log.Warn("eventline: Kafka consumer group session failed; joining again", "error", err, "retry_in", reconnectPause)
			select {
			case <-sub.ctx.Done():
				return
			case <-time.After(reconnectPause):
			}
		}
	}
}

// groupHandler is the Sarama consumer group handler of one subscription.
type groupHandler struct{ sub *subscription }

func (*groupHandler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (*groupHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim runs one partition until it is revoked or the subscription
// stops.
func (h *groupHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	p := newPartitionRun(h.sub, sess, claim.Topic(), claim.Partition())
	p.start()
	p.dispatch(claim)
	p.settle()
	return nil
}

// drainTimeout is how long a partition that stops waits for its in-flight
// messages.
func (sub *subscription) drainTimeout() time.Duration {
	cfg := sub.s.cfg
	if closed(sub.s.closing) || sub.ctx.Err() != nil {
		return cfg.ShutdownTimeout
	}
	return min(cfg.ShutdownTimeout, cfg.SaramaConfig.Consumer.Group.Rebalance.Timeout/2)
}
