package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline/internal/kafkaconf"
)

// Defaults and bounds for [SubscriberConfig] (and the matching fields of
// [Config]).
const (
	// DefaultLanes is how many lanes each partition is split into.
	DefaultLanes = 8
	// DefaultBatchSize is the most events of one lane applied in one
	// transaction.
	DefaultBatchSize = 16
	// DefaultBatchLinger is how long a lane waits for a batch to fill: 0,
	// a batch takes what is already waiting when the lane is free.
	DefaultBatchLinger = time.Duration(0)
	// MaxLanes bounds Lanes.
	MaxLanes = 256
	// MaxBatchSize bounds BatchSize.
	MaxBatchSize = 1000
	// MaxBatchLinger bounds BatchLinger.
	MaxBatchLinger = time.Second
	// DefaultCloseTimeout bounds how long Close waits for in-flight
	// messages.
	DefaultCloseTimeout = 30 * time.Second
)

// nackResendPause is the wait before a nacked message is delivered again
// (watermill-kafka's default).
const nackResendPause = 100 * time.Millisecond

// reconnectPause is the wait before joining the group again after an
// error.
const reconnectPause = time.Second

// SubscriberConfig configures a [Subscriber].
type SubscriberConfig struct {
	// Brokers are the Kafka brokers, host:port. Defaults to KAFKA_BROKERS.
	Brokers []string
	// Group is the Kafka consumer group. Required.
	Group string
	// SaramaConfig is the consumer's Sarama configuration. Defaults to one
	// that starts a new group at the oldest offset and auto-commits marked
	// offsets every second (see Config.SaramaConfig).
	SaramaConfig *sarama.Config
	// Lanes is how many lanes each partition is split into. Events are
	// spread over lanes by aggregate: one aggregate's events stay in one
	// lane, in offset order, while lanes run concurrently. 1 handles a
	// partition one event (or batch) at a time. Defaults to DefaultLanes
	// (8); at most MaxLanes.
	Lanes int
	// BatchSize is the most events of one lane delivered together as a
	// batch, which the composed eventline middleware applies in
	// one transaction. 1 disables batching. Defaults to DefaultBatchSize
	// (16); at most MaxBatchSize.
	BatchSize int
	// BatchLinger is how long a free lane waits for more events before it
	// closes a batch that is not full. 0 (the default, DefaultBatchLinger)
	// waits for nothing: a batch is what accumulated while the lane was
	// busy, so an idle consumer handles each event at once and a busy one
	// batches by itself. At most MaxBatchLinger.
	BatchLinger time.Duration
	// CloseTimeout bounds how long Close (or the end of the Subscribe
	// context) waits for delivered messages to be acknowledged; messages
	// still in flight then are abandoned (their contexts are canceled and
	// their offsets not committed). When a partition is revoked in a
	// rebalance, the wait is the shorter of CloseTimeout and half the
	// group's rebalance timeout. Defaults to DefaultCloseTimeout (30s).
	CloseTimeout time.Duration
	// Logger receives group errors and rebalances. Defaults to
	// slog.Default().
	Logger *slog.Logger

	// chainBatches is set by the ready runner, whose chain always contains
	// the eventline middleware: a batch's members go out together, without
	// first sending one alone to see whether it reaches the middleware.
	chainBatches bool
}

func (c SubscriberConfig) withDefaults() SubscriberConfig {
	if len(c.Brokers) == 0 {
		c.Brokers = kafkaconf.BrokersFromEnv()
	}
	if c.SaramaConfig == nil {
		c.SaramaConfig = kafkaconf.Consumer("eventline-" + c.Group)
	}
	if c.Lanes == 0 {
		c.Lanes = DefaultLanes
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = DefaultCloseTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c SubscriberConfig) validate(field string) error {
	if err := kafkaconf.ValidateBrokers(field+".Brokers", c.Brokers); err != nil {
		return err
	}
	if c.Group == "" {
		return errors.New(field + ".Group is empty: name the Kafka consumer group")
	}
	return validateLanes(field, c.Lanes, c.BatchSize, c.BatchLinger, c.CloseTimeout, "CloseTimeout")
}

// validateLanes checks the lane and batch settings shared by Config and
// SubscriberConfig.
func validateLanes(field string, lanes, batchSize int, linger, closeTimeout time.Duration, closeField string) error {
	switch {
	case lanes < 0 || lanes > MaxLanes:
		return fmt.Errorf("%s.Lanes is %d; use 1 to %d (0 means %d)", field, lanes, MaxLanes, DefaultLanes)
	case batchSize < 0 || batchSize > MaxBatchSize:
		return fmt.Errorf("%s.BatchSize is %d; use 1 (no batching) to %d (0 means %d)", field, batchSize, MaxBatchSize, DefaultBatchSize)
	case linger < 0 || linger > MaxBatchLinger:
		return fmt.Errorf("%s.BatchLinger is %s; use 0 to %s: a longer wait holds every batch back", field, linger, MaxBatchLinger)
	case closeTimeout < 0:
		return fmt.Errorf("%s.%s is %s; it must be positive", field, closeField, closeTimeout)
	}
	return nil
}

// Subscriber is a Watermill subscriber for Kafka consumer groups that hands
// out several events of a partition at once: each partition is split into
// lanes by aggregate, and each lane delivers its events in batches (see
// SubscriberConfig). Put it under a Router whose chain contains the
// composed eventline middleware (middleware.New): each batch is then
// applied in one PostgreSQL transaction, one aggregate's events in offset
// order, different aggregates' lanes concurrently. The ready runner
// ([Consumer.Run]) uses it unless Config.Lanes and Config.BatchSize are
// both 1.
//
// Messages are decoded with watermill-kafka's DefaultMarshaler, so UUID,
// payload and metadata are what watermill-kafka's subscriber produces. The
// record's topic, partition, offset and key are in the message context as a
// delivery.Source (dead letters record
// them); watermill-kafka's own context accessors find nothing.
//
// Delivery and offsets:
//
//   - The offset committed for a partition is the lowest offset whose
//     message has not been acknowledged: no offset ever passes an event
//     whose transaction has not committed. Acknowledged messages above it
//     are redelivered after a restart or a rebalance (the dedup records
//     make that a no-op).
//   - A nacked message is delivered again, after a short pause, before
//     anything else of its lane.
//   - A lane whose first message does not reach the eventline middleware
//     (the chain has none) gets no batches: its messages go one at a time,
//     as with watermill-kafka's subscriber.
//   - When a partition is revoked or the subscriber closes, no new message
//     is delivered; messages in flight get CloseTimeout (on revocation, at
//     most half the rebalance timeout) to be acknowledged, and their
//     offsets are committed; then the rest are abandoned: their contexts
//     are canceled (a batch transaction rolls back) and they will be
//     redelivered.
type Subscriber struct {
	cfg SubscriberConfig

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	subs    []*subscription
}

// NewSubscriber returns a Subscriber. It fails, naming the field, when the
// configuration is invalid. It does not connect to Kafka until Subscribe.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate("consumer.SubscriberConfig"); err != nil {
		return nil, err
	}
	if err := cfg.SaramaConfig.Validate(); err != nil {
		return nil, fmt.Errorf("consumer.SubscriberConfig.SaramaConfig: %w", err)
	}
	return &Subscriber{cfg: cfg, closing: make(chan struct{})}, nil
}

// errSubscriberClosed is Subscribe's error once the Subscriber is closed.
var errSubscriberClosed = errors.New("eventline: consumer.Subscriber is closed")

// subscription is one topic's consumer group membership.
type subscription struct {
	s      *Subscriber
	topic  string
	group  sarama.ConsumerGroup
	out    chan *message.Message
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
}

// Subscribe joins the consumer group for topic and returns the channel the
// topic's messages arrive on. The channel is closed when ctx ends or the
// subscriber closes, once in-flight messages are settled (see
// SubscriberConfig.CloseTimeout).
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
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
// messages get CloseTimeout to be acknowledged (their offsets are then
// committed), the rest are abandoned. It returns when every goroutine of
// the subscriber has ended. It is idempotent.
func (s *Subscriber) Close() error {
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

func (s *Subscriber) isClosing() bool {
	select {
	case <-s.closing:
		return true
	default:
		return false
	}
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
	if sub.s.isClosing() || sub.ctx.Err() != nil {
		return cfg.CloseTimeout
	}
	return min(cfg.CloseTimeout, cfg.SaramaConfig.Consumer.Group.Rebalance.Timeout/2)
}
