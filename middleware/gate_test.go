package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"math"
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

// An event claiming a version far beyond its aggregate's (a bad producer, a
// hand-made record) is refused as permanent instead of parking and, at the
// park timeout, skipping every genuine version in between. Before: it
// parked, and the sweeper skipped 2..999,999.
func TestInflatedVersionIsRefused(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{ParkTimeout: time.Nanosecond})
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	err := f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1_000_000)))
	require.ErrorIs(t, err, versioning.ErrGapTooLarge)
	require.True(t, middleware.IsPermanent(err), "dead-lettered at once")
	var gap *versioning.GapTooLargeError
	require.ErrorAs(t, err, &gap)
	require.EqualValues(t, 1, gap.Known)
	require.Equal(t, versioning.DefaultMaxGap, gap.MaxGap)
	require.Equal(t, 0, f.count(t, "parked_events"))
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_events_refused_total"))

	_, err = f.el.SweepResult(context.Background())
	require.NoError(t, err)
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 2))), "genuine versions still apply")
	require.Equal(t, []int64{1, 2}, f.versions(t, "a"))
}

// The bound counts only versions neither applied nor parked: successors
// of a lost event, parked one after another, never trip it; a jump under
// the Apply policy is bounded too.
func TestMaxGapCountsVersionsNeitherAppliedNorParked(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{MaxGap: 2, PolicyByType: map[string]versioning.GapPolicy{"thing.jumped": versioning.Apply}})
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	for v := int64(3); v <= 8; v++ {
		require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", v))), "v%d follows a parked event", v)
	}
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 11))), "leaves 9..10 missing: within 2")
	require.ErrorIs(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 15))), versioning.ErrGapTooLarge, "12..14 missing")
	jump := consumertest.Event("b", 5)
	jump.Type = "thing.jumped"
	require.ErrorIs(t, f.deliver(t, consumertest.Message(t, jump)), versioning.ErrGapTooLarge, "a jump over 1..4")
	require.Equal(t, 0, f.count(t, "skipped_versions"), "the refused jump rolled back")
}

// Versions up to MaxInt64 never overflow. Before: an aggregate at MaxInt64
// failed every later event with "bigint out of range" (version + 1 in SQL),
// dead-lettering them.
func TestVersionsUpToMaxInt64(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{GapPolicy: versioning.Apply, MaxGap: math.MaxInt64})
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", math.MaxInt64))))
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 7))), "held as late, no overflow")
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", math.MaxInt64))), "another event at MaxInt64: stale")
	require.Equal(t, []int64{math.MaxInt64}, f.versions(t, "a"))
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_late_events_total"))
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_events_stale_total"))
}

// An event that fails the Validate hook (here: its payload does not fit
// the handler) is refused before it may park or be held as late; in order,
// the handler itself rejects it.
func TestEventIsValidatedBeforeParking(t *testing.T) {
	t.Parallel()
	invalid := errors.New("payload does not decode into Thing")
	f := newFixture(t, middleware.Config{Validate: func(_ context.Context, e eventline.Event) error {
		if string(e.Payload) == `"garbage"` {
			return invalid
		}
		return nil
	}})
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	bad := consumertest.Event("a", 3)
	bad.Payload = []byte(`"garbage"`)
	err := f.deliver(t, consumertest.Message(t, bad))
	require.ErrorIs(t, err, invalid)
	require.True(t, middleware.IsPermanent(err))
	require.Equal(t, 0, f.count(t, "parked_events"))
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_events_refused_total"))
}

// withMeta returns msg's copy with one metadata entry set.
func withMeta(msg *message.Message, k, v string) *message.Message {
	c := consumertest.Redeliver(msg)
	c.Metadata.Set(k, v)
	return c
}

// Content the consumer cannot store is refused at once, whether the event
// arrives in order or must be parked; a nil payload is an empty one
// either way. Before: a null payload out of order failed the park insert
// (SQLSTATE 23502) as a retryable error, retried until dead-lettered as
// retries_exhausted.
func TestBadContentIsRefusedAtOnceInOrderOrNot(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	for name, mutate := range map[string]func(*message.Message) *message.Message{
		"NUL in correlation_id":         func(m *message.Message) *message.Message { return withMeta(m, eventline.MetaCorrelationID, "c\x00d") },
		"NUL in traceparent":            func(m *message.Message) *message.Message { return withMeta(m, eventline.MetaTraceParent, "00-\x00") },
		"NUL in a custom header":        func(m *message.Message) *message.Message { return withMeta(m, "tenant", "acme\x00") },
		"NUL in a custom header key":    func(m *message.Message) *message.Message { return withMeta(m, "ten\x00ant", "acme") },
		"invalid UTF-8 in a header":     func(m *message.Message) *message.Message { return withMeta(m, "tenant", "acme\xff") },
		"invalid UTF-8 in a header key": func(m *message.Message) *message.Message { return withMeta(m, "ten\xffant", "acme") },
	} {
		for _, v := range []int64{2, 5} { // in order, out of order
			err := f.deliver(t, mutate(consumertest.Message(t, consumertest.Event("a", v))))
			require.ErrorIs(t, err, eventline.ErrInvalidEvent, "%s, v%d", name, v)
			require.True(t, middleware.IsPermanent(err), "%s, v%d: dead-lettered at once", name, v)
		}
	}
	require.Equal(t, 0, f.count(t, "parked_events"))
	require.Equal(t, []int64{1}, f.versions(t, "a"))

	// A nil payload: parked out of order, applied in order, as empty.
	var payloads [][]byte
	f.observe = func(ctx context.Context, e eventline.Event) { payloads = append(payloads, e.Payload) }
	nilPayload := func(v int64) *message.Message {
		m := consumertest.Message(t, consumertest.Event("a", v))
		m.Payload = nil
		return m
	}
	require.NoError(t, f.deliver(t, nilPayload(3)), "parked with its nil payload")
	require.Equal(t, 1, f.count(t, "parked_events"))
	require.NoError(t, f.deliver(t, nilPayload(2)))
	require.Equal(t, []int64{1, 2, 3}, f.versions(t, "a"))
	require.Equal(t, [][]byte{{}, {}}, payloads)
}

// Parking stores metadata byte-exact: the handler of a released event sees
// what it would have seen on arrival.
func TestParkingKeepsMetadataByteExact(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	tricky := map[string]string{
		"quotes":   `"a\"b\\c'`,
		"html":     "<script>&amp;</script>",
		"unicode":  "日本語 🎉 e\u0301 \u2028\u2029 \ufeff",
		"controls": "\x01\x02\t\r\n\x1f\x7f",
		"empty":    "",
		"spaces":   "  padded  ",
		"ключ":     "значение",
	}
	var seen map[string]string
	f.observe = func(ctx context.Context, e eventline.Event) {
		if e.AggregateVersion == 3 {
			seen = e.Metadata
		}
	}
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 1))))
	e3 := consumertest.Event("a", 3)
	e3.Metadata = tricky
	e3.CorrelationID = "corr-日本"
	require.NoError(t, f.deliver(t, consumertest.Message(t, e3)))
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 2))))
	require.Equal(t, []int64{1, 2, 3}, f.versions(t, "a"))
	require.Equal(t, tricky, seen)
}

// A reused event id carried by a different event of the same aggregate
// (another version or type) is an id conflict: refused as permanent and
// counted, never skipped as a duplicate. Before: the second event was
// silently skipped and its successors parked behind the gap. On another
// aggregate the id is another event (the id is recorded per aggregate).
func TestReusedEventIDIsAConflictNotADuplicate(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	first := consumertest.Event("a", 1)
	require.NoError(t, f.deliver(t, consumertest.Message(t, first)))

	for name, other := range map[string]eventline.Event{
		"another version": consumertest.Event("a", 2),
		"another type":    func() eventline.Event { e := consumertest.Event("a", 1); e.Type = "thing.renamed"; return e }(),
	} {
		other.ID = first.ID
		err := f.deliver(t, consumertest.Message(t, other))
		require.ErrorIs(t, err, dedup.ErrIDConflict, name)
		require.True(t, middleware.IsPermanent(err), name)
		var c *dedup.IDConflictError
		require.ErrorAs(t, err, &c)
		require.Equal(t, first.AggregateID, c.Recorded.AggregateID)
		require.Equal(t, other.AggregateVersion, c.Event.AggregateVersion)
	}
	require.Equal(t, 2.0, f.metric(t, "eventline_consumer_events_refused_total"))
	require.NoError(t, f.deliver(t, consumertest.Message(t, first)), "the event itself is still a duplicate")
	require.Equal(t, 1.0, f.metric(t, "eventline_consumer_events_duplicate_total"))
	require.Equal(t, []int64{1}, f.versions(t, "a"))
	require.Equal(t, 1, f.count(t, "aggregate_versions"), "the refused events left nothing behind")
	elsewhere := consumertest.Event("b", 1)
	elsewhere.ID = first.ID
	require.NoError(t, f.deliver(t, consumertest.Message(t, elsewhere)), "another aggregate: another event")
	require.Equal(t, []int64{1}, f.versions(t, "b"))

	// Unversioned events too.
	u := consumertest.Event("c", 0)
	require.NoError(t, f.deliver(t, consumertest.Message(t, u)))
	clash := consumertest.Event("c", 0)
	clash.ID, clash.Type = u.ID, "thing.renamed"
	err := f.deliver(t, consumertest.Message(t, clash))
	require.ErrorIs(t, err, dedup.ErrIDConflict)
	require.True(t, middleware.IsPermanent(err))
}

// An event that declares its predecessor (aggregate_previous_version, as
// the producer writes it for sparse versions) leaves one known event
// missing, whatever the distance: it parks for it, and MaxGap does not
// apply. Versions 1, 2000, 4000, with v4000 delivered before v2000. Before:
// v4000 was refused as gap_too_large ("its version is probably inflated")
// and dead-lettered.
func TestDeclaredPredecessorParksBeyondMaxGap(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{PolicyByType: map[string]versioning.GapPolicy{"thing.jumped": versioning.Apply}})
	sparse := func(id string, v, prev int64) *message.Message {
		e := consumertest.Event(id, v)
		e.PreviousVersion = prev
		return consumertest.Message(t, e)
	}
	require.NoError(t, f.deliver(t, sparse("a", 1, 0)))
	require.NoError(t, f.deliver(t, sparse("a", 4000, 2000)), "v4000 waits for the one event it names")
	require.Equal(t, 1, f.count(t, "parked_events"))
	require.Equal(t, 0.0, f.metric(t, "eventline_consumer_events_refused_total"))
	require.NoError(t, f.deliver(t, sparse("a", 2000, 1)))
	require.Equal(t, []int64{1, 2000, 4000}, f.versions(t, "a"))
	require.Equal(t, 0, f.count(t, "parked_events"))
	require.Equal(t, 0, f.count(t, "skipped_versions"))

	// Under Apply, a jump over a declared predecessor is not bounded either.
	jump := consumertest.Event("b", 5000)
	jump.Type, jump.PreviousVersion = "thing.jumped", 4000
	require.NoError(t, f.deliver(t, sparse("b", 1, 0)))
	require.NoError(t, f.deliver(t, consumertest.Message(t, jump)))
	require.Equal(t, []int64{1, 5000}, f.versions(t, "b"))

	// Without a declared predecessor (it follows v-1), the bound stands.
	require.ErrorIs(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 6000))), versioning.ErrGapTooLarge)
	// A hand-made record declaring the predecessor v-1 says nothing more.
	m := consumertest.Message(t, consumertest.Event("a", 7000))
	m.Metadata.Set(eventline.MetaPreviousVersion, "6999")
	require.ErrorIs(t, f.deliver(t, m), versioning.ErrGapTooLarge)
	m.Metadata.Set(eventline.MetaPreviousVersion, "4000")
	require.NoError(t, f.deliver(t, m), "following v4000, it applies")
	require.Equal(t, []int64{1, 2000, 4000, 7000}, f.versions(t, "a"))
}
