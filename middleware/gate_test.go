package middleware_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/internal/store"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/versioning"
)

func TestApplyPolicyJumpsAndAuditsTheGap(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{GapPolicy: versioning.Apply})
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 4))))
	late := consumertest.Message(t, consumertest.Event("a", 2))
	require.NoError(t, f.deliver(t, late))
	require.Equal(t, []int64{1, 4}, f.versions(t, "a"))
	require.Equal(t, dedup.OutcomeLate, f.outcome(t, late.UUID), "a skipped version arriving later is held as late")
	skipped, err := f.el.Store().ListSkipped(context.Background(), f.env.Pool, store.SkippedFilter{Group: group})
	require.NoError(t, err)
	require.Len(t, skipped, 1)
	require.Equal(t, [2]int64{2, 3}, [2]int64{skipped[0].From, skipped[0].To})
	require.Contains(t, skipped[0].Reason, "gap policy apply")
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_gaps_skipped_total"))
}

// Reject turned one inversion into the loss of an aggregate (retrying v2
// blocked the partition, so v1 never came); it is refused with the way out.
func TestRejectPolicyIsRefused(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 1)
	for _, cfg := range []middleware.Config{
		{Group: "g", GapPolicy: versioning.Reject},
		{Group: "g", PolicyByType: map[string]versioning.GapPolicy{"thing.changed": versioning.Reject}},
	} {
		_, err := middleware.New(pool, cfg)
		require.ErrorContains(t, err, "no longer supported")
		require.ErrorContains(t, err, `use "park"`)
	}
}

func TestUnversionedEvents(t *testing.T) {
	t.Parallel()
	pass := newFixture(t, middleware.Config{})
	msg := consumertest.Message(t, consumertest.Event("a", 0))
	require.NoError(t, pass.deliver(t, msg))
	require.NoError(t, pass.deliver(t, msg))
	require.Len(t, pass.env.Effects(t, group), 1, "unversioned events are still deduplicated")
	require.Equal(t, 0, pass.count(t, "aggregate_versions"))

	reject := newFixture(t, middleware.Config{Unversioned: versioning.RejectUnversioned})
	err := reject.deliver(t, msg)
	require.ErrorIs(t, err, versioning.ErrUnversioned)
	require.True(t, middleware.IsPermanent(err))
	require.Empty(t, reject.env.Effects(t, group))
}

func TestUndecodableMessagesArePermanentAndNeverReachTheHandler(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	good := consumertest.Message(t, consumertest.Event("a", 1))
	for name, mutate := range map[string]func(*message.Message){
		"no event id":         func(m *message.Message) { delete(m.Metadata, eventline.MetaEventID) },
		"non-numeric version": func(m *message.Message) { m.Metadata.Set(eventline.MetaAggregateVersion, "two") },
		"negative version":    func(m *message.Message) { m.Metadata.Set(eventline.MetaAggregateVersion, "-1") },
		"no aggregate id":     func(m *message.Message) { delete(m.Metadata, eventline.MetaAggregateID) },
	} {
		m := consumertest.Redeliver(good)
		mutate(m)
		_, err := f.handler(m)
		require.ErrorIs(t, err, eventline.ErrInvalidEvent, name)
		require.True(t, middleware.IsPermanent(err), name)
	}
	require.Zero(t, f.calls.Load())
	require.Equal(t, 0, f.count(t, "processed_events"))
}

func TestParkConflictIsPermanent(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 3))))
	err := f.deliver(t, consumertest.Message(t, consumertest.Event("a", 3))) // another event id, same version
	require.ErrorIs(t, err, store.ErrParkConflict)
	require.True(t, middleware.IsPermanent(err))
}

// The chain dedups, parks and drains in order, and records the outcome
// (the pieces it was composed of by hand before were the same steps).
func TestChainAppliesOnceInOrder(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	el, err := middleware.New(env.Pool, middleware.Config{Group: group, Schema: env.Schema, Logger: quiet()})
	require.NoError(t, err)
	var calls int
	business := func(msg *message.Message) ([]*message.Message, error) {
		calls++
		tx, _ := middleware.TxFromContext(msg.Context())
		e, _ := middleware.EventFromContext(msg.Context())
		return nil, env.Apply(msg.Context(), tx, group, e)
	}
	h := el.MiddlewareFor("billing")(business)
	deliver := func(m *message.Message) {
		_, err := h(consumertest.Redeliver(m))
		require.NoError(t, err)
	}
	m1, m2, m3 := consumertest.Message(t, consumertest.Event("a", 1)), consumertest.Message(t, consumertest.Event("a", 2)), consumertest.Message(t, consumertest.Event("a", 3))
	deliver(m1)
	deliver(m1)
	deliver(m3)
	deliver(m2)
	require.Equal(t, 3, calls)
	var versions []int64
	for _, e := range env.Effects(t, group) {
		versions = append(versions, e.Version)
	}
	require.Equal(t, []int64{1, 2, 3}, versions)
	r, err := el.Store().FindProcessed(context.Background(), env.Pool, group, m3.UUID)
	require.NoError(t, err)
	require.Len(t, r, 1)
	require.Equal(t, dedup.OutcomeApplied, r[0].Outcome)

	// Without the middleware in front, a handler finds no transaction.
	_, ok := middleware.TxFromContext(m1.Context())
	require.False(t, ok)
}

// With several handlers, the sweeper releases each parked event through
// the handler it arrived on, found by Watermill handler name: learned when
// the handler received a message, or registered up front (needed after a
// restart, when no message has arrived yet and two handlers were wrapped).
func TestSweeperUsesTheHandlerTheEventArrivedOn(t *testing.T) {
	t.Parallel()
	env := consumertest.New(t, pgtest.Options{MaxConns: 4})
	cfg := middleware.Config{Schema: env.Schema, Group: group, ParkTimeout: time.Hour, Logger: quiet()}
	el, err := middleware.New(env.Pool, cfg)
	require.NoError(t, err)
	var mu sync.Mutex
	seen := map[string][]string{}
	named := func(name string) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			e, _ := middleware.EventFromContext(msg.Context())
			mu.Lock()
			seen[name] = append(seen[name], fmt.Sprintf("%s%d", e.AggregateID, e.AggregateVersion))
			mu.Unlock()
			return nil, nil
		}
	}
	// A real Router sets the handler names (gochannel is fine here: one
	// message at a time, no ordering under test).
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddHandler("orders", "orders", pubsub, "", nil, named("orders")).AddMiddleware(el.MiddlewareFor("orders"))
	router.AddHandler("refunds", "refunds", pubsub, "", nil, named("refunds")).AddMiddleware(el.MiddlewareFor("refunds"))
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	send := func(topic string, e eventline.Event) {
		require.NoError(t, pubsub.Publish(topic, consumertest.Message(t, e)))
	}
	send("orders", consumertest.Event("a", 1))
	send("orders", consumertest.Event("a", 3))  // parked under "orders"
	send("refunds", consumertest.Event("b", 2)) // parked under "refunds"
	send("orders", consumertest.Event("a", 2))  // drains a3 through "orders"
	require.Eventually(t, func() bool {
		return env.Count(t, "processed_events", "") == 4
	}, 10*time.Second, 20*time.Millisecond)
	require.NoError(t, router.Close())
	require.NoError(t, pubsub.Close())
	require.Equal(t, []string{"a1", "a2", "a3"}, seen["orders"])
	parked, err := el.Store().ListParked(context.Background(), env.Pool, store.ParkedFilter{Group: group})
	require.NoError(t, err)
	require.Len(t, parked, 1)
	require.Equal(t, "refunds", parked[0].Handler)

	// "Restart": a new middleware wrapping two handlers, none of them
	// named "refunds", no message yet.
	cfg.ParkTimeout = time.Nanosecond
	cfg.ReleaseBackoff.Initial = time.Nanosecond
	restarted, err := middleware.New(env.Pool, cfg)
	require.NoError(t, err)
	_ = restarted.MiddlewareFor("orders")(named("orders"))
	_ = restarted.MiddlewareFor("invoices")(named("invoices"))
	res, err := restarted.SweepResult(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, res.Failed, "two handlers wrapped and none known as \"refunds\"")
	parked, err = el.Store().ListParked(context.Background(), env.Pool, store.ParkedFilter{Group: group})
	require.NoError(t, err)
	require.Contains(t, parked[0].LastError, "no handler registered")

	// Its handler is added under its name before the router starts.
	_ = restarted.MiddlewareFor("refunds")(named("refunds"))
	res, err = restarted.SweepResult(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, res.Released)
	require.Equal(t, []string{"b2"}, seen["refunds"])
}

func TestConfigErrorsNameTheField(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 1)
	for _, tc := range []struct {
		cfg  middleware.Config
		want string
	}{
		{middleware.Config{}, "middleware.Config.Group"},
		{middleware.Config{Group: "g", Schema: "no-dashes"}, "middleware.Config.Schema"},
		{middleware.Config{Group: "g", GapPolicy: "later"}, "middleware.Config.GapPolicy"},
		{middleware.Config{Group: "g", PolicyByType: map[string]versioning.GapPolicy{"x": "nope"}}, `middleware.Config.PolicyByType["x"]`},
		{middleware.Config{Group: "g", Unversioned: "maybe"}, "middleware.Config.Unversioned"},
		{middleware.Config{Group: "g", ParkTimeout: -1}, "middleware.Config.ParkTimeout"},
		{middleware.Config{Group: "g", Retry: eventline.Backoff{Initial: time.Second, Max: time.Millisecond}}, "middleware.Config.Retry.Max"},
		{middleware.Config{Group: "g", InfraBackoff: eventline.Backoff{Multiplier: 0.5}}, "middleware.Config.InfraBackoff.Multiplier"},
		{middleware.Config{Group: "g", ReleaseBackoff: eventline.Backoff{Jitter: 2}}, "middleware.Config.ReleaseBackoff.Jitter"},
		{middleware.Config{Group: "g", MaxRetries: -2}, "middleware.Config.MaxRetries"},
		{middleware.Config{Group: "g", Middleware: []message.HandlerMiddleware{nil}}, "middleware.Config.Middleware[0]"},
	} {
		_, err := middleware.New(pool, tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := middleware.New(nil, middleware.Config{Group: "g"})
	require.ErrorContains(t, err, "middleware.New: db is nil")
}
