package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/eventline/eventline"
	"github.com/eventline/eventline/dedup"
	"github.com/eventline/eventline/internal/consumertest"
	"github.com/eventline/eventline/internal/pgtest"
	"github.com/eventline/eventline/middleware"
)

// roundTrips counts what a pool sends to the server: each query outside a
// batch and each batch is one round trip; queued counts the statements
// batches carry.
type roundTrips struct{ n, queued atomic.Int64 }

func (r *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (r *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	r.queued.Add(1)
}
func (r *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// tracedPool is a one-connection pool counting what it sends.
func tracedPool(t *testing.T) (*pgxpool.Pool, *roundTrips) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	rt := &roundTrips{}
	cfg.ConnConfig.Tracer = rt
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, pool.Ping(context.Background()))
	return pool, rt
}

// tracedMiddleware is the middleware on a one-connection pool counting
// what it sends, around a handler that applies each event with two
// statements.
func tracedMiddleware(t *testing.T) (message.HandlerFunc, *roundTrips) {
	t.Helper()
	env := consumertest.New(t, pgtest.Options{MaxConns: 2})
	pool, rt := tracedPool(t)
	el, err := middleware.New(pool, middleware.Config{Schema: env.Schema, Group: group, Logger: quiet()})
	require.NoError(t, err)
	return el.MiddlewareFor("test")(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.TxFromContext(msg.Context())
		e, _ := middleware.EventFromContext(msg.Context())
		return nil, env.Apply(msg.Context(), tx, group, e)
	}), rt
}

// A batch whose aggregates' events follow one another is admitted in one
// statement riding with BEGIN; when a member was recorded before, that
// transaction is rolled back and the members are admitted one statement
// each (which tells a duplicate from an id conflict).
func TestBatchAdmissionStatements(t *testing.T) {
	t.Parallel()
	h, rt := tracedMiddleware(t)
	x1, x2, x3, y1 := consumertest.Event("x", 1), consumertest.Event("x", 2), consumertest.Event("x", 3), consumertest.Event("y", 1)
	deliver := func(events ...eventline.Event) (batches, queued int64) {
		t.Helper()
		var msgs []*message.Message
		for _, e := range events {
			msgs = append(msgs, consumertest.Message(t, e))
		}
		n, q := rt.n.Load(), rt.queued.Load()
		for _, err := range deliverBatch(h, msgs...) {
			require.NoError(t, err)
		}
		return rt.n.Load() - n - int64(2*len(events)) - 1, rt.queued.Load() - q // less the handlers' statements and COMMIT
	}
	batches, queued := deliver(x1, y1, x2)
	require.EqualValues(t, 1, batches)
	require.EqualValues(t, 2, queued, "BEGIN and one admission for three events")
	x4 := consumertest.Event("x", 4)
	batches, queued = deliver(x3, consumertest.Event("y", 2), x4)
	require.EqualValues(t, 1, batches)
	require.EqualValues(t, 2, queued, "BEGIN and one admission for three events")

	// x4 again: recorded before. A ROLLBACK, then BEGIN and one admission per member.
	before := rt.n.Load()
	q := rt.queued.Load()
	for _, err := range deliverBatch(h, consumertest.Message(t, x4), consumertest.Message(t, consumertest.Event("x", 5))) {
		require.NoError(t, err)
	}
	require.EqualValues(t, 2+1+2, rt.queued.Load()-q, "the one statement, then BEGIN and two admissions")
	require.EqualValues(t, 1+1+1+2+1, rt.n.Load()-before, "batch, ROLLBACK, batch, x5's 2 statements, COMMIT")
}

// The hot path stays at three round trips per event (BEGIN and the
// admission in one batch, the handler's statement, COMMIT), and telling an
// id conflict from a duplicate costs none: the admission statement returns
// the recorded event's identity.
func TestHotPathRoundTrips(t *testing.T) {
	t.Parallel()
	h, rt := tracedMiddleware(t)
	cost := func(e *message.Message) (int64, error) {
		before := rt.n.Load()
		_, err := h(consumertest.Redeliver(e))
		return rt.n.Load() - before, err
	}
	first := consumertest.Event("a", 1)
	n, err := cost(consumertest.Message(t, first))
	require.NoError(t, err)
	require.EqualValues(t, 1+2+1, n, "batch(BEGIN, admit) + the handler's 2 statements + COMMIT")
	n, err = cost(consumertest.Message(t, first))
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "a duplicate: batch + COMMIT")
	clash := consumertest.Event("a", 2)
	clash.ID = first.ID
	n, err = cost(consumertest.Message(t, clash))
	require.ErrorIs(t, err, dedup.ErrIDConflict)
	require.EqualValues(t, 2, n, "an id conflict: batch + ROLLBACK, no extra query")
}
