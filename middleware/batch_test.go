package middleware_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/delivery"
	"github.com/eventline/eventline/internal/faultproxy"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

// deliverBatch runs msgs through h concurrently as the members of one
// batch (internal/delivery), as the consumer's subscriber does, and
// returns each member's error.
func deliverBatch(h message.HandlerFunc, msgs ...*message.Message) []error {
	return deliverBatchTo(context.Background(), delivery.NewBatch(), h, msgs...)
}

// deliverBatchTo is deliverBatch with the batch, and the context its
// members start from, given.
func deliverBatchTo(ctx context.Context, b *delivery.Batch, h message.HandlerFunc, msgs ...*message.Message) []error {
	errs := make([]error, len(msgs))
	var wg sync.WaitGroup
	for i, m := range msgs {
		m = consumertest.Redeliver(m)
		m.SetContext(b.Add(ctx))
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = h(m)
			b.Leave(i)
		}()
	}
	b.Seal()
	b.Run(ctx)
	wg.Wait()
	return errs
}

// TestBatchOfOneAggregateWithDuplicatesIsOneTransaction applies versions
// 1..3 of an aggregate, a duplicate of version 1 and another aggregate's
// event as one batch: one transaction, each effect once, metrics per
// event.
func TestBatchOfOneAggregateWithDuplicatesIsOneTransaction(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	x1, x2, x3, y1 := consumertest.Event("x", 1), consumertest.Event("x", 2), consumertest.Event("x", 3), consumertest.Event("y", 1)
	errs := deliverBatch(f.handler, consumertest.Message(t, x1), consumertest.Message(t, x1), consumertest.Message(t, x2), consumertest.Message(t, y1), consumertest.Message(t, x3))
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, []int64{1, 2, 3}, f.versions(t, "x"))
	require.Equal(t, []int64{1}, f.versions(t, "y"))
	xm := f.env.Transactions(t, group)
	for _, e := range []eventline.Event{x2, x3, y1} {
		require.Equal(t, xm[x1.ID], xm[e.ID], "one transaction")
	}
	require.EqualValues(t, 4, f.metric(t, "eventline_consumer_events_applied_total"))
	require.EqualValues(t, 1, f.metric(t, "eventline_consumer_events_duplicate_total"))
}

// TestBatchCommitFailureFallsBackToOneByOne makes the batch's COMMIT fail
// (a deferred unique constraint two members violate together): every
// member is then applied on its own, in order, and only the one that
// really conflicts fails.
func TestBatchCommitFailureFallsBackToOneByOne(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	uniq := f.env.CreateTable(t, "uniq", `k text, CONSTRAINT uniq_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED`)
	business := f.business(group)
	h := f.el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		e, _ := middleware.EventFromContext(msg.Context())
		if e.AggregateID == "a" || e.AggregateID == "c" {
			tx, _ := middleware.TxFromContext(msg.Context())
			if _, err := tx.Exec(msg.Context(), `INSERT INTO `+uniq+` (k) VALUES ('same')`); err != nil {
				return nil, err
			}
		}
		return business(msg)
	})
	a, b, c, d := consumertest.Event("a", 1), consumertest.Event("b", 1), consumertest.Event("c", 1), consumertest.Event("d", 1)
	errs := deliverBatch(h, consumertest.Message(t, a), consumertest.Message(t, b), consumertest.Message(t, c), consumertest.Message(t, d))
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.ErrorContains(t, errs[2], "uniq_k", "the member that conflicts fails on its own commit")
	require.NoError(t, errs[3])
	for _, id := range []string{"a", "b", "d"} {
		require.Equal(t, []int64{1}, f.versions(t, id))
	}
	require.Empty(t, f.versions(t, "c"))
	xm := f.env.Transactions(t, group)
	require.NotEqual(t, xm[a.ID], xm[b.ID], "one transaction per event after the batch failed")
	require.EqualValues(t, 3, f.metric(t, "eventline_consumer_events_applied_total"), "metrics count only committed events")
}

// TestBatchMembersThatNeverArriveDoNotHoldItUp: a member rejected before
// the composed middleware (here: a middleware in front of it) leaves the
// batch; the others are applied together.
func TestBatchMembersThatNeverArriveDoNotHoldItUp(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	reject := errors.New("rejected in front of eventline")
	batch := delivery.NewBatch()
	h := func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get(eventline.MetaAggregateID) == "rejected" {
			// Leave only once the others wait at the middleware: the batch
			// must notice the member that will never arrive.
			assert.Eventually(t, func() bool { return batch.Members() == 2 }, 30*time.Second, time.Millisecond,
				"a and b reach the middleware")
			return nil, reject
		}
		return f.handler(msg)
	}
	a, r, b := consumertest.Event("a", 1), consumertest.Event("rejected", 1), consumertest.Event("b", 1)
	errs := deliverBatchTo(context.Background(), batch, h, consumertest.Message(t, a), consumertest.Message(t, r), consumertest.Message(t, b))
	require.NoError(t, errs[0])
	require.ErrorIs(t, errs[1], reject)
	require.NoError(t, errs[2])
	xm := f.env.Transactions(t, group)
	require.Equal(t, xm[a.ID], xm[b.ID], "a and b in one transaction")
}

// TestAbandonedBatchLetsItsMembersGoAlone: when Run's context ends before
// the batch is complete, the members waiting are released to run on
// their own (with their own contexts), and Run returns.
func TestAbandonedBatchLetsItsMembersGoAlone(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	b := delivery.NewBatch()
	a := consumertest.Redeliver(consumertest.Message(t, consumertest.Event("a", 1)))
	a.SetContext(b.Add(context.Background()))
	_ = b.Add(context.Background()) // a member that never comes
	done := make(chan error, 1)
	go func() {
		_, err := f.handler(a)
		done <- err
	}()
	require.Eventually(t, func() bool { return b.Members() == 1 }, 10*time.Second, time.Millisecond, "a reaches the middleware")
	b.Seal()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	b.Run(ctx) // returns once ctx ends: the second member never arrives
	require.NoError(t, <-done, "a ran on its own")
	require.Equal(t, []int64{1}, f.versions(t, "a"))
}

// TestBatchDuringDatabaseOutage cuts the database off (every connection
// dropped, new ones refused) while a batch is in its transaction: nothing
// of the batch commits, the members fail one after the other in their
// order (each on its own, as their retries would then go on), and once the
// database is back, redelivering them applies each once, in one batch.
func TestBatchDuringDatabaseOutage(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	proxy, err := faultproxy.Start(pgtest.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	cfg, err := pgxpool.ParseConfig(pgtest.URLVia(proxy.Addr()))
	require.NoError(t, err)
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	el, err := middleware.New(pool, middleware.Config{Schema: f.env.Schema, Group: group, Logger: quiet()})
	require.NoError(t, err)
	var cut sync.Once
	business := f.business(group)
	var mu sync.Mutex
	var order []string
	h := el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		e, _ := middleware.EventFromContext(msg.Context())
		if e.AggregateID == "b" {
			cut.Do(func() {
				proxy.Set(faultproxy.Refuse)
				proxy.Drop()
			})
		}
		return business(msg)
	})
	record := func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		mu.Lock()
		order = append(order, msg.Metadata.Get(eventline.MetaAggregateID))
		mu.Unlock()
		return out, err
	}
	evs := []eventline.Event{consumertest.Event("a", 1), consumertest.Event("b", 1), consumertest.Event("c", 1)}
	msgs := []*message.Message{consumertest.Message(t, evs[0]), consumertest.Message(t, evs[1]), consumertest.Message(t, evs[2])}
	errs := deliverBatch(record, msgs...)
	for i, err := range errs {
		require.Error(t, err, "member %d cannot succeed while the database is away", i)
	}
	require.Equal(t, []string{"a", "b", "c"}, order, "the members failed one after the other, in order")
	require.Empty(t, f.env.Effects(t, group), "nothing of the batch committed")
	require.Equal(t, 0, f.count(t, "processed_events"))

	proxy.Set(faultproxy.Pass)
	errs = deliverBatch(h, msgs...)
	for _, err := range errs {
		require.NoError(t, err)
	}
	for _, id := range []string{"a", "b", "c"} {
		require.Equal(t, []int64{1}, f.versions(t, id))
	}
	xm := f.env.Transactions(t, group)
	require.Equal(t, xm[evs[0].ID], xm[evs[2].ID], "one transaction once the database is back")
}

// TestBatchRefusesAnIDConflictAlone: two different events of one
// aggregate with one id in a batch: the first is applied, the second
// refused (permanent, as on its own), the rest of the batch applied.
func TestBatchRefusesAnIDConflictAlone(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	a1, a2, c := consumertest.Event("a", 1), consumertest.Event("a", 2), consumertest.Event("c", 1)
	a2.ID = a1.ID // lies about its id
	errs := deliverBatch(f.handler, consumertest.Message(t, a1), consumertest.Message(t, a2), consumertest.Message(t, c))
	require.NoError(t, errs[0])
	require.ErrorIs(t, errs[1], dedup.ErrIDConflict)
	require.True(t, middleware.IsPermanent(errs[1]), "refused for good: dead-lettered at once")
	require.NoError(t, errs[2])
	require.Equal(t, []int64{1}, f.versions(t, "a"))
	require.Equal(t, []int64{1}, f.versions(t, "c"))
}

// TestBatchResolvesAnIDInArrivalOrder: events sharing one id in a batch,
// the first to arrive of an aggregate that sorts after the second's
// (admissions are queued by aggregate, for lock order). The event of the
// other aggregate is another event: applied. Within the first one's
// aggregate, the first to arrive wins and a later event under the id is
// refused, as one at a time. Before: the second to arrive was applied and
// the first refused.
func TestBatchResolvesAnIDInArrivalOrder(t *testing.T) {
	t.Parallel()
	f := newFixture(t, middleware.Config{})
	b1, a, c, b2 := consumertest.Event("b", 1), consumertest.Event("a", 1), consumertest.Event("c", 1), consumertest.Event("b", 2)
	a.ID, b2.ID = b1.ID, b1.ID // arrive later under b1's id
	errs := deliverBatch(f.handler, consumertest.Message(t, b1), consumertest.Message(t, a), consumertest.Message(t, c), consumertest.Message(t, b2))
	require.NoError(t, errs[0])
	require.NoError(t, errs[1], "another aggregate's event")
	require.NoError(t, errs[2])
	require.ErrorIs(t, errs[3], dedup.ErrIDConflict)
	require.True(t, middleware.IsPermanent(errs[3]), "refused for good: dead-lettered at once")
	require.Equal(t, []int64{1}, f.versions(t, "b"))
	require.Equal(t, []int64{1}, f.versions(t, "a"))
	require.Equal(t, []int64{1}, f.versions(t, "c"))
}
