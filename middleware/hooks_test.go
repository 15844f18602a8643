package middleware_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/outbox"
	"github.com/eventline/eventline/internal/sqlident"
	"github.com/eventline/eventline/middleware"
	"github.com/eventline/eventline/producer"
)

// AfterCommit hooks run for every committed application: on arrival, in a
// drain after the missing version, and by the sweeper; a hook registered
// by a parked event whose savepoint rolls back is dropped. Before: the
// handler ran for v1, v2, v3, v4 and v6, hooks only for v1 and v2.
func TestAfterCommitHooksRunForDrainedAndSweptEvents(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{ParkTimeout: time.Nanosecond, ReleaseBackoff: eventline.Backoff{Initial: time.Nanosecond}})
	var mu sync.Mutex
	var hooked []int64
	failV4 := true
	f.observe = func(ctx context.Context, e eventline.Event) {
		middleware.AfterCommit(ctx, func() {
			mu.Lock()
			hooked = append(hooked, e.AggregateVersion)
			mu.Unlock()
		})
	}
	f.fail = func(e eventline.Event) error {
		if e.AggregateVersion == 4 && failV4 {
			return errors.New("v4 fails once, after registering its hook")
		}
		return nil
	}
	hooks := func() []int64 {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(hooked)
	}
	for _, v := range []int64{1, 3, 4, 6} {
		require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", v))))
	}
	require.Equal(t, []int64{1}, hooks())
	require.NoError(t, f.deliver(t, consumertest.Message(t, consumertest.Event("a", 2))), "applies v2, drains v3, v4 fails")
	require.Equal(t, []int64{1, 2, 3}, hooks(), "v3's hook ran after the drain committed; failed v4's was dropped")

	failV4 = false
	res, err := f.el.SweepResult(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, res.Released, "v4, then v6 after skipping v5")
	require.Equal(t, []int64{1, 2, 3, 4, 6}, hooks())
	require.Equal(t, []int64{1, 2, 3, 4, 6}, f.versions(t, "a"))
}

// The at-least-once path for an external effect: the handler publishes a
// follow-up event through the producer's outbox in the consumer
// transaction. It commits with the handler's writes and the dedup record,
// or not at all; the relay then delivers it at least once to the service
// that performs the effect. AfterCommit, by contrast, is lost when the
// process dies between commit and hook.
func Example_outboxFollowUp() {
	ctx := context.Background()
	pool, schema, dropSchema := exampleDatabase()
	defer dropSchema()
	outboxRows := func() (n int) {
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+sqlident.Qualify(schema, outbox.Table(0))).Scan(&n)
		return n
	}

	prod, err := producer.New(ctx, pool, producer.Config{Schema: schema, DefaultTopic: "emails"})
	if err != nil {
		panic(err)
	}
	el, err := middleware.New(pool, middleware.Config{Schema: schema, Group: "mailer", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		panic(err)
	}
	failing := true
	handle := el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, _ := middleware.TxFromContext(ctx)
		e, _ := middleware.EventFromContext(ctx)
		send, _ := eventline.NewJSONEvent("email.requested", "order", e.AggregateID, map[string]string{"template": "receipt"})
		if err := prod.PublishTx(ctx, tx, send); err != nil {
			return nil, err
		}
		if failing {
			return nil, errors.New("the handler fails after publishing")
		}
		return nil, nil
	})
	paid, _ := eventline.Encode(eventline.Event{ID: "evt-1", Type: "order.paid", AggregateType: "order", AggregateID: "o-1", AggregateVersion: 1, Payload: []byte(`{}`)})

	_, err = handle(paid)
	fmt.Println("failed:", err != nil, "follow-ups in the outbox:", outboxRows())
	failing = false
	_, err = handle(paid) // the retry
	fmt.Println("failed:", err != nil, "follow-ups in the outbox:", outboxRows())
	_, _ = handle(paid) // a redelivery: a duplicate, nothing published
	fmt.Println("after a redelivery:", outboxRows())
	// Output:
	// failed: true follow-ups in the outbox: 0
	// failed: false follow-ups in the outbox: 1
	// after a redelivery: 1
}

// syncBuffer is a log destination safe for concurrent writers.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// hookRig registers two AfterCommit hooks per handler call: the first
// panics for the events boom names, the second records the event id.
type hookRig struct {
	f    *fixture
	logs *syncBuffer
	mu   sync.Mutex
	ran  []string
	boom map[string]bool
}

func newHookRig(t *testing.T, cfg middleware.Config) *hookRig {
	t.Helper()
	r := &hookRig{logs: &syncBuffer{}, boom: map[string]bool{}}
	cfg.Logger = slog.New(slog.NewTextHandler(r.logs, nil))
	r.f = newFixture(t, cfg)
	r.f.observe = func(ctx context.Context, e eventline.Event) {
		middleware.AfterCommit(ctx, func() {
			if r.boom[e.ID] {
				panic("hook exploded for " + e.ID)
			}
		})
		middleware.AfterCommit(ctx, func() {
			r.mu.Lock()
			r.ran = append(r.ran, e.ID)
			r.mu.Unlock()
		})
	}
	return r
}

func (r *hookRig) hooksRan() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.ran)
}

// noPanic runs fn and returns what it panicked with, so that a panic the
// code under test lets escape fails the test instead of killing the test
// binary.
func noPanic(fn func()) (v any) {
	defer func() { v = recover() }()
	fn()
	return nil
}

// A panicking AfterCommit hook, after its event committed, on each path
// that applies events: one event at a time, in a batch, and in the
// sweeper's release of parked events. The panic is recovered where the
// hooks run (RunAfterCommit and the sweeper's hooks), logged with the
// event, counted in eventline_consumer_after_commit_panics_total, and the
// remaining hooks (the event's own, the other members', the gate's
// metrics) run. Before: the batch path and the sweeper let it escape (the
// consumer process died with the data committed and the other members'
// hooks lost), and the one-event path turned it into a failure of an
// event already committed (retried, then skipped as a duplicate).
func TestPanickingAfterCommitHookIsRecoveredOnEveryPath(t *testing.T) {
	t.Parallel()
	t.Run("one event", func(t *testing.T) {
		t.Parallel()
		r := newHookRig(t, middleware.Config{})
		a := consumertest.Event("a", 1)
		r.boom[a.ID] = true
		var err error
		require.Nil(t, noPanic(func() { err = r.f.deliver(t, consumertest.Message(t, a)) }), "the panic must not escape")
		require.NoError(t, err, "the event committed: it is acknowledged")
		require.Equal(t, []string{a.ID}, r.hooksRan(), "the hook after the panicking one ran")
		r.check(t, 1, a)
	})
	t.Run("batch", func(t *testing.T) {
		t.Parallel()
		r := newHookRig(t, middleware.Config{})
		a, b, c := consumertest.Event("a", 1), consumertest.Event("b", 1), consumertest.Event("c", 1)
		r.boom[b.ID] = true
		var errs []error
		require.Nil(t, noPanic(func() {
			errs = deliverBatch(r.f.handler, consumertest.Message(t, a), consumertest.Message(t, b), consumertest.Message(t, c))
		}), "the panic must not escape the batch")
		for i, err := range errs {
			require.NoError(t, err, "member %d", i)
		}
		xm := r.f.env.Transactions(t, group)
		require.Equal(t, xm[a.ID], xm[c.ID], "one transaction")
		require.Equal(t, []string{a.ID, b.ID, c.ID}, r.hooksRan(), "every member's hooks ran, b's second one too")
		r.check(t, 3, b)
	})
	t.Run("sweeper", func(t *testing.T) {
		t.Parallel()
		r := newHookRig(t, middleware.Config{ParkTimeout: time.Nanosecond})
		a2, b2 := consumertest.Event("a", 2), consumertest.Event("b", 2)
		r.boom[a2.ID] = true
		for _, e := range []eventline.Event{a2, b2} {
			require.NoError(t, r.f.deliver(t, consumertest.Message(t, e)), "parks: v1 is missing")
		}
		var err error
		require.Nil(t, noPanic(func() { err = r.f.el.Sweep(context.Background()) }), "the panic must not escape the sweeper")
		require.NoError(t, err)
		require.ElementsMatch(t, []string{a2.ID, b2.ID}, r.hooksRan(), "both released events' hooks ran")
		require.Equal(t, []int64{2}, r.f.versions(t, "a"))
		require.Equal(t, []int64{2}, r.f.versions(t, "b"))
		require.EqualValues(t, 2, r.f.metric(t, "eventline_consumer_parked_released_total"), "the sweeper's metrics hook ran")
		require.EqualValues(t, 1, r.f.metric(t, "eventline_consumer_after_commit_panics_total"))
		require.Contains(t, r.logs.String(), a2.ID, "logged with the event")
	})
}

// check checks the metrics and the log after one hook of e panicked and
// applied events were applied.
func (r *hookRig) check(t *testing.T, applied int, e eventline.Event) {
	t.Helper()
	require.EqualValues(t, applied, r.f.metric(t, "eventline_consumer_events_applied_total"), "the gate's own hooks ran")
	require.EqualValues(t, 1, r.f.metric(t, "eventline_consumer_after_commit_panics_total"))
	logs := r.logs.String()
	require.Contains(t, logs, "hook exploded for "+e.ID)
	require.Contains(t, logs, fmt.Sprintf("event_id=%s", e.ID), "logged with the event")
	require.Contains(t, logs, "aggregate_id="+e.AggregateID)
}

// A hook registered on a transaction's context made without the
// middleware (eventlinetest runs handlers directly so: delivery.WithTx,
// then RunAfterCommit after its commit) that panics does not stop the hooks
// after it; the panic is logged (through slog's default logger: there is
// no middleware to name a logger). Not parallel: it replaces the default
// logger.
func TestRunAfterCommitRunsTheHooksAfterAPanickingOne(t *testing.T) {
	logs := &syncBuffer{}
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(logs, nil)))
	t.Cleanup(func() { slog.SetDefault(prev) })
	ctx := delivery.WithTx(context.Background(), nil)
	var ran []int
	middleware.AfterCommit(ctx, func() { ran = append(ran, 1) })
	middleware.AfterCommit(ctx, func() { panic("boom") })
	middleware.AfterCommit(ctx, func() { ran = append(ran, 3) })
	require.Nil(t, noPanic(func() { delivery.RunAfterCommit(ctx) }))
	require.Equal(t, []int{1, 3}, ran)
	require.Contains(t, logs.String(), "AfterCommit hook panicked")
}
