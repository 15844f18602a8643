package middleware_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/held"
	"github.com/eventline/eventline/internal/kafkaconf"
	"github.com/eventline/eventline/internal/kafkatest"
	"github.com/eventline/eventline/internal/metrictest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

// kafkaRouter is a Router, a watermill-kafka publisher and a subscriber of
// group on fresh topics of a test Kafka.
type kafkaRouter struct {
	router  *message.Router
	pub     message.Publisher
	sub     message.Subscriber
	brokers []string
	topic   string
	poison  string
}

func newKafkaRouter(t *testing.T, group string) *kafkaRouter {
	t.Helper()
	brokers := kafkatest.Brokers(t)
	k := &kafkaRouter{brokers: brokers, topic: kafkatest.Topic(t, "orders"), poison: kafkatest.Topic(t, "poison")}
	kafkatest.CreateTopic(t, brokers, k.topic, 1)
	kafkatest.CreateTopic(t, brokers, k.poison, 1)
	logger := watermill.NopLogger{}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: kafkaconf.Producer("test")}, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	sc := kafka.DefaultSaramaSubscriberConfig()
	sc.Consumer.Offsets.Initial = sarama.OffsetOldest
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: brokers, Unmarshaler: kafka.DefaultMarshaler{},
		ConsumerGroup: group + "-" + randomHex(), OverwriteSaramaConfig: sc}, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	k.router, k.pub, k.sub = router, pub, sub
	return k
}

func (k *kafkaRouter) run(t *testing.T) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = k.router.Run(context.Background())
	}()
	<-k.router.Running()
	t.Cleanup(func() {
		_ = k.router.Close()
		<-done
	})
}

func (k *kafkaRouter) publish(t *testing.T, msgs ...*message.Message) {
	t.Helper()
	for _, m := range msgs {
		require.NoError(t, k.pub.Publish(k.topic, m))
	}
}

// The README used to say: add eventline to the handler, then
// router.AddMiddleware(poisonQueue, retry). That makes eventline ▸
// PoisonQueue ▸ Retry: a failing handler's event went to the poison topic,
// PoisonQueue returned nil, and eventline committed the dedup record and
// the version advance with no effects. Now the event is refused, nothing
// is committed, and the refusal is logged and counted.
func TestPoisonQueueInsideEventlineIsRefusedNotCommitted(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	reg := prometheus.NewRegistry()
	metrics, err := middleware.NewMetrics(reg)
	require.NoError(t, err)
	el, err := middleware.New(env.Pool, middleware.Config{Schema: env.Schema, Group: group, Logger: quiet(), Metrics: metrics})
	require.NoError(t, err)
	k := newKafkaRouter(t, group)

	k.router.AddConsumerHandler("billing", k.topic, k.sub, func(msg *message.Message) error {
		tx, _ := middleware.TxFromContext(msg.Context())
		e, _ := middleware.EventFromContext(msg.Context())
		if err := env.Apply(msg.Context(), tx, group, e); err != nil {
			return err
		}
		return errors.New("smtp down")
	}).AddMiddleware(el.MiddlewareFor("billing"))
	poison, err := wmiddleware.PoisonQueue(k.pub, k.poison)
	require.NoError(t, err)
	k.router.AddMiddleware(poison, wmiddleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond, ResetContextOnRetry: true, ShouldRetry: func(p wmiddleware.RetryParams) bool { return !middleware.IsPermanent(p.Err) }}.Middleware)
	k.run(t)

	e := consumertest.Event("o-1", 1)
	k.publish(t, consumertest.Message(t, e))
	deadline := time.Now().Add(60 * time.Second)
	for metrictest.Sum(t, reg, "eventline_consumer_unsafe_compositions_total") < 2 {
		require.True(t, time.Now().Before(deadline), "the unsafe chain must be detected, and again on redelivery")
		time.Sleep(20 * time.Millisecond) // polling interval
	}
	require.NoError(t, k.router.Close())

	processed := env.Count(t, "processed_events", "")
	require.Zero(t, processed, "the event must not be marked processed: its handler failed")
	require.Zero(t, env.Count(t, "aggregate_versions", ""))
	require.Empty(t, env.Effects(t, group))
}

// Eventline.AddHandler is the one call that composes dead letters, retries
// and eventline safely, whatever the router adds around it.
func TestAddHandlerComposesTheSafeChainInOneCall(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	el, err := middleware.New(env.Pool, middleware.Config{Schema: env.Schema, Group: group, Logger: quiet(),
		Retry: eventline.Backoff{Initial: time.Millisecond}})
	require.NoError(t, err)
	k := newKafkaRouter(t, group)
	var flaky atomic.Int32
	_, err = el.AddHandler(k.router, "billing", k.topic, k.sub, func(msg *message.Message) error {
		tx, _ := middleware.TxFromContext(msg.Context())
		e, _ := middleware.EventFromContext(msg.Context())
		switch e.AggregateID {
		case "flaky":
			if flaky.Add(1) <= 2 {
				return errors.New("downstream hiccup")
			}
		case "poison":
			return middleware.Permanent(errors.New("cannot handle this one"))
		}
		return env.Apply(msg.Context(), tx, group, e)
	})
	require.NoError(t, err)
	_, err = el.AddHandler(k.router, "billing", k.topic, k.sub, func(*message.Message) error { return nil })
	require.ErrorContains(t, err, "already has a handler")
	// A poison queue and a retry added to the router afterwards stay
	// outside the chain: they never see a failure it dead-lettered.
	poison, err := wmiddleware.PoisonQueue(k.pub, k.poison)
	require.NoError(t, err)
	k.router.AddMiddleware(poison, wmiddleware.Retry{MaxRetries: 3}.Middleware)
	k.run(t)

	ok1, fl, bad, ok2 := consumertest.Event("a", 1), consumertest.Event("flaky", 1), consumertest.Event("poison", 1), consumertest.Event("b", 1)
	k.publish(t, consumertest.Message(t, ok1), consumertest.Message(t, fl), consumertest.Message(t, bad), consumertest.Message(t, ok2))
	deadline := time.Now().Add(60 * time.Second)
	for len(env.Effects(t, group)) < 3 {
		require.True(t, time.Now().Before(deadline), "the good events are applied")
		time.Sleep(20 * time.Millisecond) // polling interval
	}
	require.NoError(t, k.router.Close())

	got := map[string]int{}
	for _, e := range env.Effects(t, group) {
		got[e.EventID]++
	}
	require.Equal(t, map[string]int{ok1.ID: 1, fl.ID: 1, ok2.ID: 1}, got)
	require.EqualValues(t, 3, flaky.Load(), "two failures, then success")
	dls, err := held.New(env.Schema).List(context.Background(), env.Pool, held.Filter{Group: group})
	require.NoError(t, err)
	require.Len(t, dls, 1)
	require.Equal(t, bad.ID, dls[0].EventID)
	require.Equal(t, dedup.KindPermanent, dls[0].Cause)
	require.Equal(t, "billing", dls[0].Handler)
	require.Equal(t, k.topic, dls[0].Topic)
	require.True(t, dls[0].FromKafka)
	var poisoned int
	kafkatest.Consume(t, k.brokers, k.poison, time.Second, func(*sarama.ConsumerMessage) bool { poisoned++; return false })
	require.Zero(t, poisoned, "nothing reached the router's poison queue")
}

// TestUnsafeRefusalHoldsTheMessage: a refusal for an unsafe composition is
// the same on every delivery, so the middleware holds the message (after
// the rollback) before answering, instead of letting a Router without
// eventline's Retry redeliver it in a tight loop. Not parallel: it swaps
// the pause for a counter.
func TestUnsafeRefusalHoldsTheMessage(t *testing.T) {
	holds := middleware.CountUnsafeHolds(t)
	env := consumertest.New(t, pgtest.Options{MaxConns: 2})
	el, err := middleware.New(env.Pool, middleware.Config{Schema: env.Schema, Group: group, Logger: quiet()})
	require.NoError(t, err)
	// What Watermill's PoisonQueue does inside the chain: publish the failed
	// message, mark it poisoned, return nil.
	poisonedInside := el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		msg.Metadata.Set(wmiddleware.ReasonForPoisonedKey, "smtp down")
		return nil, nil
	})
	for i := 1; i <= 2; i++ {
		_, err = poisonedInside(consumertest.Message(t, consumertest.Event("o-1", 1)))
		require.ErrorIs(t, err, middleware.ErrUnsafeComposition)
		require.EqualValues(t, i, holds.Load(), "each refusal holds the message before answering")
	}
	require.Zero(t, env.Count(t, "processed_events", ""))

	// A handler's ordinary failure is answered at once.
	failing := el.MiddlewareFor("test")(func(*message.Message) ([]*message.Message, error) { return nil, errors.New("smtp down") })
	_, err = failing(consumertest.Message(t, consumertest.Event("o-2", 1)))
	require.Error(t, err)
	require.EqualValues(t, 2, holds.Load())
}
