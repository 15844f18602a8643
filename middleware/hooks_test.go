package middleware_test

import (
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
