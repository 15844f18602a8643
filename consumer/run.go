package consumer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/eventline/eventline/internal/backoff"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/internal/wmlog"
	"github.com/eventline/eventline/middleware"
)

// Run consumes until ctx ends, then shuts down gracefully and returns nil.
//
// It subscribes to Config.Topics in Config.Group, spreads each partition
// over lanes and applies their events in batches (see the package
// documentation, "Lanes and batches"), running every message through the
// middleware's chain (middleware.Eventline.AddHandler), outermost first:
// dead-lettering ▸ retries ▸ a detached context ▸ the event-type check ▸
// Config.Middleware ▸ the eventline transaction (dedup ▸ version gate) ▸
// the handler registered for the event's type. The sweeper for parked
// events runs next to it (middleware.Eventline.Run), and replays the dead
// letters an operator asked to replay (`eventline held replay`).
//
// When ctx ends Run stops taking messages, lets in-flight events finish
// (their transactions commit or roll back as usual) for up to
// Config.ShutdownTimeout, stops the sweeper, closes its Kafka clients and
// returns. A message whose retries (or wait for the database) were cut
// short by the shutdown is not dead-lettered: it is left unacknowledged and
// redelivered later.
//
// Run returns an error when it cannot start (the consumer's schema is not
// migrated, a Sarama configuration error) or when the router stops on its
// own. A consumer started while Kafka or its database is unavailable
// waits for it, logging a warning that names the brokers (or the database
// error) at every try, and then starts; so does one whose brokers go away
// before it has joined its group. A stop meanwhile is clean. Once it has
// joined, it rejoins by itself after a Kafka outage.
func (c *Consumer) Run(ctx context.Context) (err error) {
	c.mu.Lock()
	if c.running {
		c.mu.Unlock()
		return ErrRunning
	}
	if len(c.handlers) == 0 && len(c.ignored) == 0 {
		c.mu.Unlock()
		return ErrNoHandlers
	}
	c.running = true
	c.mu.Unlock()

	cfg := c.cfg
	wlog := wmlog.New(cfg.Logger.With("component", "watermill", "group", cfg.Group))

	if err := c.waitForKafka(ctx); err != nil {
		return err
	}
	if err := c.checkSchema(ctx); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return nil // cancelled before it started: a clean stop
	}
	slots := c.coalesce // a test's, or:
	if slots == 0 {
		slots = coalesceSlots(c.db, cfg.Lanes)
	}
	// soft ends when the shutdown begins: retries and waits stop. hard
	// ends when in-flight events must be abandoned. The subscriber ends
	// its messages' contexts with them (partitionRun).
	hard, abandon := context.WithCancel(context.Background())
	defer abandon()
	soft, stopping := context.WithCancel(context.Background())
	defer stopping()
	c.hard = hard
	sub := newSubscriber(cfg, slots, c.coalesceHook, soft, hard)
	defer sub.Close()

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: cfg.ShutdownTimeout}, wlog)
	if err != nil {
		return fmt.Errorf("eventline consumer: create router: %w", err)
	}
	if c.sleep != nil {
		// The router's own middleware runs outside each handler's chain.
		router.AddMiddleware(c.withSleep)
	}
	for _, topic := range cfg.Topics {
		waiting := waitingSubscriber{Subscriber: sub, ctx: ctx, wait: c.waitKafka}
		if _, err := c.el.AddHandler(router, handlerName(cfg.Group, topic), topic, waiting, c.dispatch); err != nil {
			return fmt.Errorf("eventline consumer: %w", err)
		}
	}

	runErr := make(chan error, 1)
	// The router runs detached from ctx: shutdown is router.Close below,
	// which lets in-flight events finish instead of cancelling them.
	go func() { runErr <- router.Run(context.WithoutCancel(ctx)) }()
	sweepCtx, stopSweeper := context.WithCancel(context.WithoutCancel(ctx))
	sweeperDone := make(chan struct{})
	go func() {
		defer close(sweeperDone)
		_ = c.el.Run(sweepCtx)
	}()
	defer func() {
		stopSweeper()
		<-sweeperDone
	}()

	// Let the router finish starting before honouring ctx, so Close finds
	// every handler it has to wait for.
	select {
	case <-router.Running():
	case err := <-runErr:
		return stoppedOnItsOwn(ctx, err)
	}
	select {
	case <-ctx.Done():
	case err := <-runErr:
		return stoppedOnItsOwn(ctx, err)
	}
	cfg.Logger.InfoContext(ctx, "eventline: consumer shutting down; finishing in-flight events", "group", cfg.Group, "timeout", cfg.ShutdownTimeout)
	stopping()
	closeErr := router.Close()
	abandon()
	<-runErr
	if closeErr != nil {
		cfg.Logger.Warn("eventline: consumer shutdown timed out; unfinished events were rolled back and will be redelivered", "group", cfg.Group, "error", closeErr)
	}
	return nil
}

// withSleep makes the chain's retries and waits sleep with c.sleep
// (tests).
func (c *Consumer) withSleep(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
		msg.SetContext(backoff.WithSleep(orig, c.sleep))
		defer msg.SetContext(orig)
		return h(msg)
	}
}

// stoppedOnItsOwn is what Run returns when the router returned err before
// Run asked it to stop.
func stoppedOnItsOwn(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		// A stop while the router was starting: a subscription still
		// waiting for Kafka ends its handler, and the router may stop
		// before Run sees ctx end. The caller asked for it: a clean stop.
		return nil
	}
	if err == nil {
		err = errors.New("the router stopped on its own (see the logs)")
	}
	return fmt.Errorf("eventline consumer: %w", err)
}

// checkSchema checks, before anything is consumed, what the middleware's
// Run checks again before sweeping: that the consumer tables exist,
// waiting while the database is unavailable (see Run). It returns nil if
// ctx ends first.
func (c *Consumer) checkSchema(ctx context.Context) error {
	st, err := store.New(c.cfg.Schema)
	if err != nil {
		return err
	}
	var problem string
	err = backoff.Retry(ctx, c.cfg.InfraBackoff, middleware.IsInfrastructure,
		func(wait time.Duration, err error) {
			c.cfg.Logger.WarnContext(ctx, "eventline: the consumer's database is unavailable; waiting for it before consuming",
				"group", c.cfg.Group, "wait", wait, "error", err)
		},
		func() (err error) {
			problem, err = st.Unmigrated(ctx, c.db)
			return err
		})
	switch {
	case err != nil:
		return err
	case problem != "":
		return fmt.Errorf("%w: %s", middleware.ErrNotMigrated, problem)
	}
	return nil
}

// waitForKafka connects to the brokers, waiting while none answers (see
// Run); a Sarama configuration error fails at once. It warns about topics
// that do not exist yet (eventline creates none) and returns nil if ctx
// ends first.
func (c *Consumer) waitForKafka(ctx context.Context) error {
	brokers := strings.Join(c.cfg.Brokers, ",")
	var client sarama.Client
	err := c.waitKafka(ctx, func() (err error) {
		client, err = sarama.NewClient(c.cfg.Brokers, kafkaconf.Consumer("eventline-check-"+c.cfg.Group))
		return err
	})
	if err != nil {
		return fmt.Errorf("eventline consumer: connect to the Kafka brokers %s: %w", brokers, err)
	}
	if client == nil {
		return nil // ctx ended first
	}
	defer client.Close()
	topics, err := client.Topics()
	if err != nil {
		c.cfg.Logger.WarnContext(ctx, "eventline: cannot list the consumer's topics", "group", c.cfg.Group, "brokers", brokers, "error", err)
		return nil
	}
	have := map[string]bool{}
	for _, t := range topics {
		have[t] = true
	}
	for _, t := range c.cfg.Topics {
		if !have[t] {
			c.cfg.Logger.WarnContext(ctx, "eventline: topic does not exist; create it (eventline creates no topics)", "group", c.cfg.Group, "topic", t)
		}
	}
	return nil
}

// waitKafka runs try until it succeeds, fails for another reason than
// Kafka being unavailable (a Sarama configuration error), or ctx ends
// (then it returns nil), waiting on the database-wait schedule and
// logging each wait with the brokers' names.
func (c *Consumer) waitKafka(ctx context.Context, try func() error) error {
	brokers := strings.Join(c.cfg.Brokers, ",")
	unavailable := func(err error) bool {
		var mistake sarama.ConfigurationError
		return !errors.As(err, &mistake) && !errors.Is(err, errSubscriberClosed)
	}
	return backoff.Retry(ctx, c.cfg.InfraBackoff, unavailable, func(wait time.Duration, err error) {
		c.cfg.Logger.WarnContext(ctx, "eventline: cannot reach the Kafka brokers; waiting for them before consuming",
			"group", c.cfg.Group, "brokers", brokers, "wait", wait, "error", err,
			"check", "consumer.Config.Brokers (or "+kafkaconf.BrokersEnv+") and that the brokers are up")
	}, try)
}

// waitingSubscriber subscribes with the subscriber it wraps, waiting (the
// wait policy) while Kafka is unavailable: Kafka may go between
// waitForKafka and the router's Subscribe, which joins the consumer group.
// Once subscribed, both subscribers rejoin by themselves after an outage.
// wait runs under Run's ctx: when it ends, Subscribe gives up and returns
// a closed channel.
type waitingSubscriber struct {
	message.Subscriber
	ctx  context.Context
	wait func(ctx context.Context, try func() error) error
}

func (s waitingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	var out <-chan *message.Message
	err := s.wait(s.ctx, func() (err error) {
		out, err = s.Subscriber.Subscribe(ctx, topic)
		return err
	})
	if err == nil && out == nil {
		// Run stopped meanwhile. No error: watermill's router, when a
		// Subscribe fails, leaves goroutines behind that wait for the
		// handler for good. A closed channel ends the handler instead.
		closed := make(chan *message.Message)
		close(closed)
		return closed, nil
	}
	return out, err
}

// detach gives the rest of the chain a context that survives the end of
// the message's own context (it ends when the shutdown begins), so an
// event in flight at shutdown finishes its transaction, and that is
// canceled only when in-flight work must be abandoned: when the
// partition's hard context ends (partitionRun), else the consumer's.
func (c *Consumer) detach(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
		ctx, cancel := context.WithCancel(context.WithoutCancel(orig))
		hard, ok := orig.Value(hardKey{}).(context.Context)
		if !ok {
			hard = c.hard
		}
		if hard == nil {
			hard = context.Background() // not run by Run
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
