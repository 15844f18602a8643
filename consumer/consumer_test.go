package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/consumer"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

func TestConsumerAppliesEachEventOnceInOrder(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 4)
	const group = "orders"
	c := k.newConsumer(t, k.config(group))
	require.NoError(t, c.Handle("thing.changed", k.applyHandler(group)))

	// 10 aggregates × 5 versions, published shuffled per aggregate and with
	// every third event twice: the pipeline can reorder and duplicate.
	var want []eventline.Event
	var msgs []*message.Message
	for a := 0; a < 10; a++ {
		var evs []eventline.Event
		for v := int64(1); v <= 5; v++ {
			evs = append(evs, consumertest.Event(fmt.Sprintf("agg-%d", a), v))
		}
		want = append(want, evs...)
		rand.Shuffle(len(evs), func(i, j int) { evs[i], evs[j] = evs[j], evs[i] })
		for i, e := range evs {
			msgs = append(msgs, consumertest.Message(t, e))
			if i%3 == 0 {
				msgs = append(msgs, consumertest.Message(t, e))
			}
		}
	}
	publish(t, k.brokers, k.topic, msgs...)
	r := start(t, c)
	eventually(t, 60*time.Second, func() bool { return len(k.Effects(t, group)) >= len(want) }, "all events applied")
	require.NoError(t, r.stop())
	appliedOnce(t, k.Effects(t, group), want)
	for a := 0; a < 10; a++ {
		value, last := k.State(t, group, "thing", fmt.Sprintf("agg-%d", a))
		require.EqualValues(t, 5, last)
		require.Equal(t, fold(1, 2, 3, 4, 5), value, "final state equals in-order application")
	}
	require.Equal(t, 0, k.Count(t, "parked_events", ""))
}

func TestBadInputIsDeadLetteredAndThePartitionMoves(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1) // one partition: bad and good messages share it
	const group = "billing"
	cfg := k.config(group)
	cfg.Metrics, _ = middleware.NewMetrics(nil)
	c := k.newConsumer(t, cfg)
	type payment struct {
		Amount int `json:"amount"`
	}
	var amounts atomic.Int64
	require.NoError(t, consumer.HandleJSON(c, "payment.received", func(ctx context.Context, tx pgx.Tx, e eventline.Event, p payment) error {
		amounts.Add(int64(p.Amount))
		return k.Apply(ctx, tx, group, e)
	}))

	raw := func(id string, md map[string]string, payload string) *message.Message {
		m := message.NewMessage(id, []byte(payload))
		for key, v := range md {
			m.Metadata.Set(key, v)
		}
		return m
	}
	envelope := func(id, typ, agg, version string) map[string]string {
		md := map[string]string{eventline.MetaEventType: typ, eventline.MetaAggregateType: "account", eventline.MetaAggregateID: agg, eventline.MetaAggregateVersion: version}
		if id != "" {
			md[eventline.MetaEventID] = id
		}
		return md
	}
	good := func(agg string, v int64, amount int) eventline.Event {
		e, err := eventline.NewJSONEvent("payment.received", "account", agg, payment{Amount: amount})
		require.NoError(t, err)
		e.ID, e.AggregateVersion = eventline.NewEventID(), v
		return e
	}
	first, second, third := good("acct-1", 1, 10), good("acct-1", 2, 20), good("acct-2", 1, 30)
	bad := []*message.Message{
		raw("no-id", envelope("", "payment.received", "acct-x", "1"), `{"amount":1}`),
		raw("nan", envelope("nan", "payment.received", "acct-y", "two"), `{"amount":1}`),
		raw("neg", envelope("neg", "payment.received", "acct-z", "-3"), `{"amount":1}`),
		raw("unknown", envelope("unknown", "payment.refunded", "acct-u", "1"), `{"amount":1}`),
		raw("undecodable", envelope("undecodable", "payment.received", "acct-v", "1"), `{"amount":"lots"}`),
	}
	msgs := []*message.Message{consumertest.Message(t, first)}
	msgs = append(msgs, bad...)
	msgs = append(msgs, consumertest.Message(t, second), consumertest.Message(t, third))
	publish(t, k.brokers, k.topic, msgs...)

	r := start(t, c)
	dead := deadLetters(t, k, group, len(bad))
	eventually(t, 30*time.Second, func() bool { return len(k.Effects(t, group)) == 3 }, "good messages after the bad ones are applied")
	require.NoError(t, r.stop())
	appliedOnce(t, k.Effects(t, group), []eventline.Event{first, second, third})
	require.EqualValues(t, 60, amounts.Load())

	reasons := map[string]string{}
	for _, d := range dead {
		require.Equal(t, dedup.KindPermanent, d.Cause, "bad input is not retried")
		require.Equal(t, group, d.Group)
		require.Equal(t, k.topic, d.Topic)
		require.False(t, d.HeldAt.IsZero())
		reasons[d.MessageUUID] = d.Reason
	}
	require.Contains(t, reasons["no-id"], "event_id")
	require.Contains(t, reasons["nan"], "aggregate_version")
	require.Contains(t, reasons["neg"], "aggregate_version")
	require.Contains(t, reasons["unknown"], `no handler for event type "payment.refunded"`)
	require.Contains(t, reasons["undecodable"], "payload")
	// Nothing of the bad messages was recorded: their transactions rolled back.
	require.Equal(t, 3, k.Count(t, "processed_events", ""))
}

func TestPanickingHandlerIsRolledBackAndRetried(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "shipping"
	c := k.newConsumer(t, k.config(group))
	var attempts atomic.Int32
	require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		if err := k.Apply(ctx, tx, group, e); err != nil {
			return err
		}
		if attempts.Add(1) <= 2 {
			panic("flaky handler")
		}
		return nil
	}))
	e := consumertest.Event("a", 1)
	publish(t, k.brokers, k.topic, consumertest.Message(t, e))
	r := start(t, c)
	eventually(t, 30*time.Second, func() bool { return len(k.Effects(t, group)) == 1 }, "applied after the panics")
	require.NoError(t, r.stop())
	require.EqualValues(t, 3, attempts.Load())
	appliedOnce(t, k.Effects(t, group), []eventline.Event{e})
}

func TestExhaustedRetriesAreDeadLetteredWithNothingRecorded(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "mailer"
	c := k.newConsumer(t, k.config(group))
	var attempts atomic.Int32
	require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		if e.AggregateID == "poison" {
			attempts.Add(1)
			if err := k.Apply(ctx, tx, group, e); err != nil {
				return err
			}
			return errors.New("smtp down")
		}
		return k.Apply(ctx, tx, group, e)
	}))
	poison, after := consumertest.Event("poison", 1), consumertest.Event("fine", 1)
	publish(t, k.brokers, k.topic, consumertest.Message(t, poison), consumertest.Message(t, after))
	r := start(t, c)
	dead := deadLetters(t, k, group, 1)
	eventually(t, 30*time.Second, func() bool { return len(k.Effects(t, group)) == 1 }, "the next message is applied")
	require.NoError(t, r.stop())
	require.Equal(t, dedup.KindRetriesExhausted, dead[0].Cause)
	require.Contains(t, dead[0].Reason, "smtp down")
	require.EqualValues(t, 3, attempts.Load(), "1 attempt + MaxRetries (2)")
	appliedOnce(t, k.Effects(t, group), []eventline.Event{after})
	require.Equal(t, 0, k.Count(t, "processed_events", `WHERE event_id = $1`, poison.ID))
}

func TestShutdownFinishesInFlightEvent(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	const group = "slow"
	cfg := k.config(group)
	logger, stopping := watchLog(partitionStopping)
	cfg.Logger = logger
	c := k.newConsumer(t, cfg)
	entered, release := make(chan struct{}), make(chan struct{})
	require.NoError(t, c.Handle("thing.changed", func(ctx context.Context, tx pgx.Tx, e eventline.Event) error {
		close(entered)
		<-release
		return k.Apply(ctx, tx, group, e)
	}))
	e := consumertest.Event("a", 1)
	publish(t, k.brokers, k.topic, consumertest.Message(t, e))
	r := start(t, c)
	select {
	case <-entered:
	case <-time.After(60 * time.Second):
		t.Fatal("handler never called")
	}
	stoppingNow := stopping.Next()
	stopped := make(chan error, 1)
	go func() { stopped <- r.stop() }()
	// Release the handler only once the shutdown has reached its partition
	// (it stops taking events and waits for the one in flight): released
	// earlier, the event would finish as in any run, and the test would
	// prove nothing about shutdown.
	waitFor(t, stoppingNow, 60*time.Second, "the partition stops while the handler is busy")
	require.EqualValues(t, 1, stopping.MaxInt("events"), "the partition stopped with the event in flight")
	close(release)
	require.NoError(t, <-stopped)
	appliedOnce(t, k.Effects(t, group), []eventline.Event{e})
}

func TestConfigErrorsNameTheField(t *testing.T) {
	t.Parallel()
	env := pgtest.Pool(t, 1)
	base := consumer.Config{Config: middleware.Config{Group: "g"}, Brokers: []string{"127.0.0.1:9092"}, Topics: []string{"t"}}
	for _, tc := range []struct {
		mut  func(*consumer.Config)
		want string
	}{
		{func(c *consumer.Config) { c.Group = "" }, "consumer.Config.Group"},
		{func(c *consumer.Config) { c.Topics = nil }, "consumer.Config.Topics"},
		{func(c *consumer.Config) { c.Topics = []string{"bad topic"} }, "consumer.Config.Topics"},
		{func(c *consumer.Config) { c.Brokers = []string{"nohost"} }, "consumer.Config.Brokers"},
		{func(c *consumer.Config) { c.Schema = "x;drop" }, "consumer.Config.Schema"},
		{func(c *consumer.Config) { c.GapPolicy = "maybe" }, "GapPolicy"},
		{func(c *consumer.Config) { c.Retry.Multiplier = 0.5 }, "consumer.Config.Retry.Multiplier"},
		{func(c *consumer.Config) { c.ParkTimeout = -time.Second }, "ParkTimeout"},
		{func(c *consumer.Config) { c.Lanes = -1 }, "consumer.Config.Lanes"},
		{func(c *consumer.Config) { c.Lanes = consumer.MaxLanes + 1 }, "consumer.Config.Lanes"},
		{func(c *consumer.Config) { c.BatchSize = -1 }, "consumer.Config.BatchSize"},
		{func(c *consumer.Config) { c.BatchSize = consumer.MaxBatchSize + 1 }, "consumer.Config.BatchSize"},
		{func(c *consumer.Config) { c.BatchLinger = -time.Millisecond }, "consumer.Config.BatchLinger"},
		{func(c *consumer.Config) { c.BatchLinger = 2 * consumer.MaxBatchLinger }, "consumer.Config.BatchLinger"},
	} {
		cfg := base
		tc.mut(&cfg)
		_, err := consumer.New(env, cfg)
		require.ErrorContains(t, err, tc.want)
	}
	c, err := consumer.New(env, base)
	require.NoError(t, err)
	require.NoError(t, c.Handle("a", func(context.Context, pgx.Tx, eventline.Event) error { return nil }))
	require.Error(t, c.Handle("a", func(context.Context, pgx.Tx, eventline.Event) error { return nil }), "duplicate handler")
	require.Error(t, c.Ignore("a"))
}

func fold(versions ...int64) int64 {
	var v int64
	for _, x := range versions {
		v = consumertest.Fold(v, x)
	}
	return v
}

// A consumer whose context is already canceled starts, stops and leaves
// nothing behind (goleak in TestMain checks the goroutines).
func TestRunWithCanceledContextReturnsCleanly(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	c := k.newConsumer(t, k.config("early"))
	require.NoError(t, c.Handle("thing.changed", k.applyHandler("early")))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.NoError(t, c.Run(ctx))
	require.ErrorIs(t, c.Run(ctx), consumer.ErrRunning, "a consumer runs once")
	require.ErrorIs(t, c.Handle("x", k.applyHandler("early")), consumer.ErrRunning)
}

// A consumer with no handler and nothing ignored refuses to run: before,
// it ran and dead-lettered every event of its topics as unknown.
func TestRunRefusesAConsumerWithoutHandlers(t *testing.T) {
	t.Parallel()
	k := newKenv(t, 1)
	c := k.newConsumer(t, k.config("nohandlers"))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.ErrorIs(t, c.Run(ctx), consumer.ErrNoHandlers)
	require.NoError(t, c.Ignore("thing.changed"), "the consumer did not start: it still takes registrations")
}

// A nil *pgxpool.Pool held in the interface is refused by New, like an
// untyped nil; before, New accepted it and Run panicked.
func TestNewRefusesANilPoolPointer(t *testing.T) {
	var pool *pgxpool.Pool
	_, err := consumer.New(pool, consumer.Config{Config: middleware.Config{Group: "g"}, Brokers: []string{"127.0.0.1:1"}, Topics: []string{"t"}})
	require.ErrorContains(t, err, "db is nil")
}
