package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/middleware"
)

// Metadata keys set on a dead-lettered message, next to its original
// metadata. DeadLetterReasonKey and DeadLetterTopicKey are Watermill's
// PoisonQueue keys, so Watermill tooling reads them too.
const (
	// DeadLetterReasonKey holds the error that dead-lettered the event.
	DeadLetterReasonKey = wmiddleware.ReasonForPoisonedKey
	// DeadLetterTopicKey holds the topic the event was consumed from.
	DeadLetterTopicKey = wmiddleware.PoisonedTopicKey
	// DeadLetterHandlerKey holds the Watermill handler name.
	DeadLetterHandlerKey = wmiddleware.PoisonedHandlerKey
	// DeadLetterKindKey classifies the reason: DeadLetterPermanent or
	// DeadLetterRetriesExhausted.
	DeadLetterKindKey = "eventline_dead_kind"
	// DeadLetterGroupKey holds the consumer group that gave up.
	DeadLetterGroupKey = "eventline_dead_group"
	// DeadLetterAtKey holds when, RFC 3339.
	DeadLetterAtKey = "eventline_dead_at"
)

// The values of DeadLetterKindKey.
const (
	DeadLetterPermanent        = "permanent"
	DeadLetterRetriesExhausted = "retries_exhausted"
)

// maxReasonBytes bounds the reason header (a panic's stack can be long).
const maxReasonBytes = 8 << 10

// Run consumes until ctx ends, then shuts down gracefully and returns nil.
//
// It subscribes to Config.Topics in Config.Group with watermill-kafka (one
// partition is processed one message at a time, so a partition's order is
// kept), and runs every message through, outermost first: dead-lettering ▸
// retry with exponential backoff (permanent errors skip it) ▸ a detached
// context ▸ the event-type check ▸ Config.Middleware ▸ the eventline
// middleware (recover ▸ tx ▸ decode ▸ dedup ▸ version gate) ▸ the handler
// registered for the event's type. The sweeper for parked events runs next
// to it.
//
// When ctx ends Run stops taking messages, lets in-flight events finish
// (their transactions commit or roll back as usual) for up to
// Config.ShutdownTimeout, stops the sweeper, closes its Kafka clients and
// returns. A message whose retries were cut short by the shutdown is not
// dead-lettered: it is left unacknowledged and redelivered later.
//
// Run returns an error when it cannot start (Kafka unreachable…) or when
// the router stops on its own.
func (c *Consumer) Run(ctx context.Context) (err error) {
	c.mu.Lock()
	if c.running {
		c.mu.Unlock()
		return ErrRunning
	}
	c.running = true
	c.mu.Unlock()

	cfg := c.cfg
	wlog := watermill.NewSlogLoggerWithLevelMapping(cfg.Logger.With("component", "watermill", "group", cfg.Group),
		map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug})

	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               cfg.Brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: cfg.SaramaConfig,
		ConsumerGroup:         cfg.Group,
	}, wlog)
	if err != nil {
		return fmt.Errorf("eventline consumer: create Kafka subscriber: %w", err)
	}
	defer sub.Close()
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:               cfg.Brokers,
		Marshaler:             kafka.NewWithPartitioningMarshaler(deadLetterKey),
		OverwriteSaramaConfig: kafkaconf.Producer("eventline-dlq-" + cfg.Group),
	}, wlog)
	if err != nil {
		return fmt.Errorf("eventline consumer: create dead-letter publisher: %w", err)
	}
	defer pub.Close()

	c.checkTopics(ctx)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: cfg.ShutdownTimeout}, wlog)
	if err != nil {
		return fmt.Errorf("eventline consumer: create router: %w", err)
	}
	hard, abandon := context.WithCancel(context.Background())
	defer abandon()
	c.hard = hard

	retry := wmiddleware.Retry{
		MaxRetries:          cfg.MaxRetries,
		InitialInterval:     cfg.RetryInitialInterval,
		MaxInterval:         cfg.RetryMaxInterval,
		Multiplier:          cfg.RetryMultiplier,
		RandomizationFactor: 0.2,
		ResetContextOnRetry: true,
		ShouldRetry: func(p wmiddleware.RetryParams) bool {
			return middleware.ShouldRetry(p) && !c.stopping.Load()
		},
		Logger: wlog,
	}
	router.AddMiddleware(c.deadLetter(pub), retry.Middleware, c.detach, c.knownType)
	router.AddMiddleware(cfg.Middleware...)
	router.AddMiddleware(c.el.Middleware)
	for _, topic := range cfg.Topics {
		name := HandlerName(cfg.Group, topic)
		router.AddConsumerHandler(name, topic, sub, func(msg *message.Message) error {
			_, err := c.dispatch(msg)
			return err
		})
		c.el.Register(name, c.dispatch)
	}

	runErr := make(chan error, 1)
	// The router runs detached from ctx: shutdown is router.Close below,
	// which lets in-flight events finish instead of cancelling them.
	go func() { runErr <- router.Run(context.WithoutCancel(ctx)) }()
	sweepCtx, stopSweeper := context.WithCancel(context.WithoutCancel(ctx))
	var sweeper sync.WaitGroup
	sweeper.Add(1)
	go func() {
		defer sweeper.Done()
		_ = c.el.RunSweeper(sweepCtx)
	}()
	defer func() {
		stopSweeper()
		sweeper.Wait()
	}()

	// Let the router finish starting before honouring ctx, so Close finds
	// every handler it has to wait for.
	select {
	case <-router.Running():
	case err := <-runErr:
		return stoppedOnItsOwn(err)
	}
	select {
	case <-ctx.Done():
	case err := <-runErr:
		return stoppedOnItsOwn(err)
	}
	cfg.Logger.InfoContext(ctx, "eventline: consumer shutting down; finishing in-flight events", "group", cfg.Group, "timeout", cfg.ShutdownTimeout)
	c.stopping.Store(true)
	closeErr := router.Close()
	abandon()
	<-runErr
	if closeErr != nil {
		cfg.Logger.Warn("eventline: consumer shutdown timed out; unfinished events were rolled back and will be redelivered", "group", cfg.Group, "error", closeErr)
	}
	return nil
}

func stoppedOnItsOwn(err error) error {
	if err == nil {
		err = errors.New("the router stopped on its own (see the logs)")
	}
	return fmt.Errorf("eventline consumer: %w", err)
}

// checkTopics warns about topics that do not exist yet: eventline creates
// none, and a missing dead-letter topic makes every dead letter fail (the
// message is then redelivered until the topic exists).
func (c *Consumer) checkTopics(ctx context.Context) {
	client, err := sarama.NewClient(c.cfg.Brokers, kafkaconf.Consumer("eventline-check-"+c.cfg.Group))
	if err != nil {
		c.cfg.Logger.WarnContext(ctx, "eventline: cannot check the consumer's topics", "group", c.cfg.Group, "error", err)
		return
	}
	defer client.Close()
	topics, err := client.Topics()
	if err != nil {
		c.cfg.Logger.WarnContext(ctx, "eventline: cannot check the consumer's topics", "group", c.cfg.Group, "error", err)
		return
	}
	have := map[string]bool{}
	for _, t := range topics {
		have[t] = true
	}
	for _, t := range append([]string{c.cfg.DeadLetterTopic}, c.cfg.Topics...) {
		if !have[t] {
			c.cfg.Logger.WarnContext(ctx, "eventline: topic does not exist; create it (eventline creates no topics)", "group", c.cfg.Group, "topic", t)
		}
	}
}

// detach gives the rest of the chain a context that survives the end of
// the message's own context (the subscriber cancels it when it closes), so
// an event in flight at shutdown finishes its transaction, and that is
// canceled only when in-flight work must be abandoned.
func (c *Consumer) detach(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
		ctx, cancel := context.WithCancel(context.WithoutCancel(orig))
		hard := c.hard
		if hard == nil {
			hard = context.Background()
		}
		stop := context.AfterFunc(hard, cancel)
		defer func() {
			stop()
			cancel()
			msg.SetContext(orig)
		}()
		msg.SetContext(ctx)
		return h(msg)
	}
}

// deadLetter publishes a message whose handling failed (permanently, or
// after the last retry) to the dead-letter topic with the reason, and acks
// it, like Watermill's PoisonQueue. If the publish fails the error stands
// and the message is redelivered. During shutdown only permanent failures
// are dead-lettered; others stay unacknowledged.
func (c *Consumer) deadLetter(pub message.Publisher) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				return out, nil
			}
			permanent := middleware.IsPermanent(err)
			if !permanent && (c.stopping.Load() || errors.Is(err, context.Canceled)) {
				return nil, err
			}
			kind := DeadLetterRetriesExhausted
			if permanent {
				kind = DeadLetterPermanent
			}
			ctx := msg.Context()
			dl := msg.Copy()
			dl.Metadata.Set(DeadLetterReasonKey, truncate(err.Error(), maxReasonBytes))
			dl.Metadata.Set(DeadLetterKindKey, kind)
			dl.Metadata.Set(DeadLetterTopicKey, message.SubscribeTopicFromCtx(ctx))
			dl.Metadata.Set(DeadLetterHandlerKey, message.HandlerNameFromCtx(ctx))
			dl.Metadata.Set(DeadLetterGroupKey, c.cfg.Group)
			dl.Metadata.Set(DeadLetterAtKey, time.Now().UTC().Format(time.RFC3339Nano))
			if perr := pub.Publish(c.cfg.DeadLetterTopic, dl); perr != nil {
				c.cfg.Logger.ErrorContext(ctx, "eventline: cannot publish to the dead-letter topic; the message will be redelivered",
					"group", c.cfg.Group, "topic", c.cfg.DeadLetterTopic, "message_uuid", msg.UUID, "error", perr)
				return nil, errors.Join(err, fmt.Errorf("publish to dead-letter topic %s: %w", c.cfg.DeadLetterTopic, perr))
			}
			c.cfg.Metrics.DeadLettered(c.cfg.Group, kind)
			c.cfg.Logger.WarnContext(ctx, "eventline: message dead-lettered", "group", c.cfg.Group, "topic", c.cfg.DeadLetterTopic,
				"message_uuid", msg.UUID, "event_type", msg.Metadata.Get(eventline.MetaEventType), "kind", kind, "error", err)
			return nil, nil
		}
	}
}

// deadLetterKey keys dead letters like the original events: by aggregate.
func deadLetterKey(_ string, msg *message.Message) (string, error) {
	if k := msg.Metadata.Get(eventline.MetaAggregateID); k != "" {
		return k, nil
	}
	return msg.UUID, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "…"
}
